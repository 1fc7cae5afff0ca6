"""A ckptd URL is parsed in one place (trainer_client/core/_ckptd_url.py): TCP or ``unix:///ABS/PATH``, and a
malformed one refused in one line naming what is wrong, when the settings are built (``CKPTD_URL`` included),
never at the first request. ``ckptd serve --uds`` checks its path with the same rule
(tests/server/cli/test_serve_uds.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer_client.config import ClientSettings
from trainer_client.core._ckptd_url import SUN_PATH_BYTES, UDS_BASE_URL, CkptdAddress, parse_ckptd_url

LONGEST = "/" + "s" * (SUN_PATH_BYTES - 2)  # SUN_PATH_BYTES - 1 bytes: fits, with sun_path's terminating NUL


@pytest.mark.parametrize(("url", "address"), [
    ("http://127.0.0.1:9471", CkptdAddress("http://127.0.0.1:9471", "http://127.0.0.1:9471")),
    ("https://ckptd.example:443/prefix", CkptdAddress("https://ckptd.example:443/prefix",
                                                      "https://ckptd.example:443/prefix")),
    ("unix:///run/ckptd/ckptd.sock", CkptdAddress("unix:///run/ckptd/ckptd.sock", UDS_BASE_URL,
                                                  "/run/ckptd/ckptd.sock")),
    ("UNIX:///tmp/a b.sock", CkptdAddress("UNIX:///tmp/a b.sock", UDS_BASE_URL, "/tmp/a b.sock")),  # as written
    (f"unix://{LONGEST}", CkptdAddress(f"unix://{LONGEST}", UDS_BASE_URL, LONGEST)),
])
def test_the_forms_a_ckptd_answers_on(url: str, address: CkptdAddress) -> None:
    assert parse_ckptd_url(url) == address
    assert ClientSettings(url=url).url == url


@pytest.mark.parametrize(("url", "says"), [
    ("unix://ckptd.sock", "the socket path must be absolute, after three slashes (unix:///abs/path/to.sock; "
                          "'ckptd.sock' would be a host)"),
    ("unix://./run/ckptd.sock", "the socket path must be absolute"),
    ("unix://", "names no socket: give unix:///ABS/PATH/TO.sock"),
    ("unix:///", "names no socket: give unix:///ABS/PATH/TO.sock"),
    ("unix:///run/ckptd/", "the socket path '/run/ckptd/' names a directory, not a socket file"),
    (f"unix://{LONGEST}s", f"the socket path is {SUN_PATH_BYTES} bytes, longer than a unix socket's path may be "
                           f"({SUN_PATH_BYTES - 1} bytes, sun_path): choose a shorter directory"),
    ("unix:///run/\x00.sock", "has a NUL character in the socket path"),
    ("127.0.0.1:9471", "has no scheme: give http://HOST:PORT or unix:///ABS/PATH/TO.sock"),
    ("http://", "names no host"),
    ("ftp://ckptd:21", "'ftp' is not a scheme ckptd answers on"),
])
def test_a_malformed_url_is_one_line_naming_it(url: str, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"ckptd URL") as raised:
        parse_ckptd_url(url)
    message = str(raised.value)
    assert says in message and repr(url) in message and "\n" not in message
    if "\x00" in url:
        return  # an environment variable cannot hold a NUL
    monkeypatch.setenv("CKPTD_URL", url)  # what a trainer is given: refused when its settings are read
    with pytest.raises(ValidationError) as invalid:
        ClientSettings()
    assert says in str(invalid.value)

