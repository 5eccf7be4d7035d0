"""The adapter store's Prometheus metrics, read from the host tier's counters at scrape time."""

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adapter_store.host_cache import HostCache

_COUNTERS = {  # metric -> (help, CacheStats field)
    "loraplex_store_host_tier_hits": ("Fetches served from the host-RAM tier.", "hits"),
    "loraplex_store_host_tier_misses": ("Fetches that started a blob (S3) read.", "misses"),
    "loraplex_store_host_tier_joined": ("Fetches that waited on another fetch's read.", "joined"),
    "loraplex_store_blob_reads": ("Whole-object reads from the blob store (S3), retries included.",
                                  "blob_reads"),
    "loraplex_store_blob_read_bytes": ("Bytes read from the blob store (S3).", "bytes_read"),
    "loraplex_store_checksum_failures": ("Reads whose size or sha256 did not match.",
                                         "checksum_failures"),
    "loraplex_store_host_tier_evictions": ("Adapters dropped from the host-RAM tier.", "evictions"),
    "loraplex_store_host_tier_read_through": (
        "Reads served and not kept: larger than the tier, or no room in time.", "read_through"),
}


class _CacheCollector:
    def __init__(self, cache: HostCache):
        self._cache = cache

    def collect(self):
        stats = self._cache.stats
        for name, (doc, field) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        hits, misses = stats.hits, stats.misses + stats.joined
        ratio = GaugeMetricFamily("loraplex_store_host_tier_hit_ratio",
                                  "Share of fetches served from RAM since start.",
                                  value=hits / (hits + misses) if hits + misses else 0.0)
        yield ratio
        yield GaugeMetricFamily("loraplex_store_host_tier_bytes",
                                "Bytes of the adapters in the host-RAM tier.",
                                value=self._cache.num_bytes)
        yield GaugeMetricFamily("loraplex_store_host_tier_reserved_bytes",
                                "Bytes the host-RAM tier reserves for reads in flight.",
                                value=self._cache.reserved_bytes)


def store_registry(cache: HostCache) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_CacheCollector(cache))
    return registry
