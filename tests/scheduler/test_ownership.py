"""Each part of the scheduler's state has one writer (scheduler/executor_state.py,
scheduler/core.py), checked from the source: an attribute of another object (not `self.`) that
names a field of an executor's, a request's or a sequence's state is assigned only in the
modules that own it."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "scheduler"
BUILDERS = {"sequence.py", "step_builder.py", "fast_steps.py", "reference_steps.py", "cohort.py"}
OWNERS = {
    # ExecutorState
    **dict.fromkeys(["work_tokens", "executor"], {"placement.py"}),
    **dict.fromkeys(["load_failures", "fetching_since", "adapter_loads", "adapter_hits",
                     "adapter_evictions", "caused_load"], {"residency.py"}),
    **dict.fromkeys(["merge", "dedicated_to", "dedicated_bytes", "merged_slot", "unmerge_due",
                     "unmerging"], {"merging.py"}),
    **dict.fromkeys(["is_up", "is_draining", "is_leaving", "is_stopping", "steps_since_up",
                     "steps_run", "blocks", "counters"],
                    {"core.py"}),
    # Request
    **dict.fromkeys(["status", "arrival", "queued_since", "admitted_at", "finish_reason",
                     "executor_failures"], {"core.py"}),
    **dict.fromkeys(["cache_key", "runs_long"], {"core.py", "longrope.py"}),
    **dict.fromkeys(["is_charged", "cached_prompt_tokens"], {"admission.py"}),
    "first_token_at": {"request.py"},
    # Sequence
    **dict.fromkeys(["num_computed", "num_known", "last_step", "is_sent", "capacity"], BUILDERS),
    **dict.fromkeys(["num_published", "publish_at"], {"prefix_cache.py"}),
    **dict.fromkeys(["quiet_below", "decode_below", "decode_row"], {"fast_steps.py"}),
    **dict.fromkeys(["cohort", "joined_at", "leaves_at"], {"cohort.py"}),
}

# Messages' fields of the same names, not the scheduler's state.
MESSAGE_FIELDS = {("streams.py", "finish_reason")}  # (StreamEnd.finish_reason)


def assigned_attributes(tree: ast.AST):
    """(attribute name, line) of every `x.name = ...` (also augmented, annotated, unpacked)
    whose object is not `self`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        stack = list(targets)
        while stack:
            target = stack.pop()
            if isinstance(target, ast.Tuple | ast.List):
                stack.extend(target.elts)
            elif isinstance(target, ast.Attribute) and not (
                    isinstance(target.value, ast.Name) and target.value.id == "self"):
                yield target.attr, target.lineno


def test_each_field_is_written_only_by_its_owner():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        for name, line in assigned_attributes(ast.parse(path.read_text(), str(path))):
            owners = OWNERS.get(name)
            if owners is not None and path.name not in owners and \
                    (path.name, name) not in MESSAGE_FIELDS:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} writes .{name} "
                             f"(owned by {', '.join(sorted(owners))})")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_assignments():
    """(The scan must find what it looks for, or the test above could never fail.)"""
    found = set(assigned_attributes(ast.parse("a.b = 1\nc.d, (e.f, g) = x\nh.i += 1\n"
                                              "self.j = 2\n")))
    assert {name for name, _ in found} == {"b", "d", "f", "i"}
