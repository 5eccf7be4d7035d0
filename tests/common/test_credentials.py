"""Keys: read from files or the environment, in order; an empty key file is an error, never
open access; short keys and a key given two roles are refused."""

import pytest

from common.credentials import (
    DEFAULT_TENANT,
    OPERATOR,
    Caller,
    KeySources,
    Role,
    bearer,
    request_tenant,
)
from common.errors import InvalidArgument

A, B, ADMIN = "tenant-a-key-0000000001", "tenant-b-key-0000000001", "admin-key-00000000000001"
OLD, NEW = "service-key-old-00000001", "service-key-new-00000001"


def test_keys_from_files_and_env_and_the_presented_service_key_is_the_first(tmp_path):
    (tmp_path / "api").write_text(f"# tenants\n{A}=acme\n")
    (tmp_path / "svc").write_text(f"{NEW}\n{OLD}\n")
    keys = KeySources(str(tmp_path / "api"), "", str(tmp_path / "svc")).load(
        {"LORAPLEX_API_KEYS": f"{B}=globex", "LORAPLEX_ADMIN_KEYS": ADMIN})
    assert keys.identify(A).tenant == "acme" and keys.identify(B).tenant == "globex"
    assert keys.identify(ADMIN).role is Role.ADMIN
    assert keys.identify(OLD).role is Role.SERVICE and keys.service_key == NEW
    assert keys.identify("no-such-key-000000000") is None and not keys.is_open


def test_no_source_is_open_but_an_empty_file_is_refused(tmp_path):
    assert KeySources().load({}).is_open
    (tmp_path / "empty").write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        KeySources(admin_keys_file=str(tmp_path / "empty")).load({})


@pytest.mark.parametrize("environ, match", [
    ({"LORAPLEX_ADMIN_KEYS": "short"}, "shorter than 16"),
    ({"LORAPLEX_API_KEYS": f"{A}"}, "KEY=TENANT"),
    ({"LORAPLEX_API_KEYS": f"{A}=acme", "LORAPLEX_ADMIN_KEYS": A}, "given twice"),
])
def test_bad_keys_are_refused_at_start(environ, match):
    with pytest.raises(ValueError, match=match):
        KeySources().load(environ)


def test_the_tenant_of_a_request_is_defined_once_for_every_service():
    """Open: DEFAULT_TENANT. A tenant key: its own, whatever the request names. A service key:
    the tenant it names on behalf of, INVALID_ARGUMENT (the caller's message) when none."""
    acme, service = Caller(Role.TENANT, "acme"), Caller(Role.SERVICE)
    assert request_tenant(OPERATOR, True, "globex", "unnamed") == DEFAULT_TENANT
    assert request_tenant(acme, False, "globex", "unnamed") == "acme"
    assert request_tenant(service, False, "globex", "unnamed") == "globex"
    with pytest.raises(InvalidArgument, match="name the tenant"):
        request_tenant(service, False, "", "name the tenant")


def test_the_bearer_scheme_is_case_insensitive():
    """RFC 7235: "bearer" and "BEARER" are "Bearer"; a value without the scheme is the key."""
    for value in (f"Bearer {A}", f"bearer {A}", f"BEARER  {A} ", A):
        assert bearer([("authorization", value)]) == A, value
    assert bearer([("x-api-key", A)]) == "" and bearer([("authorization", b"bytes")]) == ""
