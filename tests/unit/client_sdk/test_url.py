from __future__ import annotations

import pytest

from kvoffload.client_sdk import Client
from kvoffload.client_sdk.url import parse_url
from kvoffload.errors import ConfigError


def test_parse_local_url() -> None:
    url = parse_url("local:///var/kv?dram=1GiB&policy=prefix")
    assert (url.scheme, url.host, url.path) == ("local", "", "/var/kv")
    assert dict(url.params) == {"dram": "1GiB", "policy": "prefix"}
    remote = parse_url("kv://10.0.0.5:7480")
    assert (remote.host, remote.port) == ("10.0.0.5", 7480)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis://localhost", "unknown URL scheme"),
        ("not a url", "not a store URL"),
        ("local://?dram=1GiB&dram=2GiB", "repeated"),
        ("local://?colour=blue", "unknown local:// URL parameter"),
        ("local://?dram=lots", "cannot parse size"),
        ("local://?policy=mru", "unknown eviction policy"),
        ("local://?prefault=maybe", "prefault"),
        ("local://somehost/dir", "take a path"),
        ("kv://host:99999", "bad port"),
    ],
)
def test_bad_urls_are_clear_config_errors(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Client.connect(url)
