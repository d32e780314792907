"""services/gateway/front_door.py's checks alone (the ASGI door and h11 against real sockets:
tests/system/api/test_gateway_hardening.py)."""

import pytest

from services.gateway.api_errors import ApiError
from services.gateway.front_door import declared_length, needs_api_key


def test_limits_before_work():
    assert needs_api_key("/v1/models") and needs_api_key("/v1/anything") and not needs_api_key("/health")
    assert declared_length([(b"content-length", b"10")], 100) == 10
    assert declared_length([(b"transfer-encoding", b"chunked")], 100) is None
    with pytest.raises(ApiError) as caught:
        declared_length([(b"content-length", b"300000000")], 8 << 20)
    assert (caught.value.status, caught.value.code) == (413, "request_too_large")
    with pytest.raises(ApiError) as caught:
        declared_length([(b"content-length", b"ten")], 100)
    assert caught.value.status == 400
