"""Adapter pages (common/adapter_pages.py): every chunk of every rank row has a place of its own
inside one region, pages follow the ranks an adapter really has, and a config's rank_pattern
sets each module's rank."""

import json

import pytest

from common.adapter_pages import PageGeometry, module_ranks, padded_pages, plan_pages
from common.peft.config import parse_config

LLAMA_8B = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024),
            "o_proj": (4096, 4096), "gate_proj": (4096, 14336), "up_proj": (4096, 14336),
            "down_proj": (14336, 4096)}
TINY = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
        "gate_proj": (256, 688), "up_proj": (256, 688), "down_proj": (688, 256)}


def check_disjoint(layout, geometry):
    """Each chunk in one region, no two overlapping, chunks of a row covering it in order."""
    spans = {}
    for m, places in layout.modules.items():
        in_f, out_f = geometry.module_shapes[m]
        for rows, length in ((places.a, in_f), (places.b, out_f)):
            assert len(rows) == places.rank
            for chunks in rows:
                sizes = [min(geometry.chunk_elems, length - c * geometry.chunk_elems)
                         for c in range(len(chunks))]
                assert sum(sizes) == length and all(s > 0 for s in sizes)
                for place, size in zip(chunks, sizes):
                    assert 0 <= place.page < layout.num_pages and place.half in (0, 1)
                    assert 0 <= place.offset and place.offset + size <= geometry.region_elems
                    spans.setdefault((place.page, place.half), []).append(
                        (place.offset, place.offset + size))
    for region, used in spans.items():
        used.sort()
        assert all(a[1] <= b[0] for a, b in zip(used, used[1:])), f"overlap in {region}"
    assert sum(e - s for used in spans.values() for s, e in used) == layout.used_elems


@pytest.mark.parametrize("shapes,region", [(LLAMA_8B, 16 * 8 * 128), (TINY, 16 * 2 * 64),
                                           (LLAMA_8B, 1000)])  # (1000: rows in many chunks)
@pytest.mark.parametrize("ranks", [{"q_proj": 1}, {"q_proj": 16, "v_proj": 16},
                                   dict.fromkeys(LLAMA_8B, 8),
                                   {"q_proj": 64, "down_proj": 3, "gate_proj": 256}])
def test_every_chunk_has_a_place_of_its_own(shapes, region, ranks):
    geometry = PageGeometry(4, region, shapes)
    layout = plan_pages(ranks, geometry)
    check_disjoint(layout, geometry)
    assert set(layout.modules) == set(ranks)


def test_pages_follow_the_real_rank_not_a_maximum():
    geometry = PageGeometry(32, 16 * 8 * 128, LLAMA_8B)
    pages = {r: plan_pages(dict.fromkeys(LLAMA_8B, r), geometry).num_pages
             for r in (8, 16, 64, 256)}
    assert pages[16] == 2 * pages[8] and pages[64] == 8 * pages[8] and pages[256] == 32 * pages[8]
    rank8 = plan_pages(dict.fromkeys(LLAMA_8B, 8), geometry)
    assert rank8.fill(geometry) > 0.9  # (little slack: the rows pack their regions)
    assert padded_pages(64, geometry) == pages[64]  # a max-rank-64 slot: 8x a rank-8 adapter
    attention = plan_pages({"q_proj": 16, "v_proj": 16}, geometry).num_pages
    assert attention < pages[16] / 5  # only the modules it targets


def test_a_rank_pattern_sets_each_modules_largest_rank():
    config = parse_config(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "base_model_name_or_path": "m",
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "rank_pattern": {"model.layers.1.self_attn.v_proj": 32, "down_proj": 4,
                         "nonexistent_proj": 64}}))
    assert module_ranks(config, ["down_proj", "q_proj", "v_proj"], num_layers=4) == {
        "q_proj": 8, "v_proj": 32, "down_proj": 4}
