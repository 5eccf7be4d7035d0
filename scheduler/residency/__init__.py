"""The residency wing: which adapter sits in which slot of each executor, how adapters get there
(staging, loads, backoff), who pins them, and how their pages share the executor's KV blocks."""
