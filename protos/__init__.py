"""The contracts between loraplex services (package loraplex.v1) and their generated code.

Regenerate with `make protos`; tests/common/test_protos.py fails when the generated files are stale.
"""
