"""Where the dashboard's token comes from, and what is refused: a file others can read, an
empty token (the command line's refusals are in test_cli.py, the served rules in
test_dashboard.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("panel")
from nbdist.dashboard.access import TOKEN_ENV, TokenError, dashboard_token


def test_the_token_comes_from_a_file_else_the_environment_else_chance(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    first, second = dashboard_token(), dashboard_token()
    assert first != second and len(first) >= 32
    monkeypatch.setenv(TOKEN_ENV, " from-the-environment\n")
    assert dashboard_token() == "from-the-environment"
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    token_file.chmod(0o600)
    assert dashboard_token(token_file) == "from-the-file"
    token_file.chmod(0o400)
    assert dashboard_token(token_file) == "from-the-file"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_file_other_users_can_read_or_write_is_refused(tmp_path, mode):
    token_file = tmp_path / "token"
    token_file.write_text("seen-by-others")
    token_file.chmod(mode)
    with pytest.raises(TokenError) as refused:
        dashboard_token(token_file)
    assert f"--token-file {token_file} can be read or written by other users" in str(refused.value)
    assert f"chmod 600 {token_file}" in str(refused.value)


def test_a_missing_or_empty_token_is_an_error(tmp_path, monkeypatch):
    with pytest.raises(TokenError, match=r"--token-file .*/absent: No such file"):
        dashboard_token(tmp_path / "absent")
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(TokenError, match=r"is empty: write the token into it"):
        dashboard_token(tmp_path / "empty")
    monkeypatch.setenv(TOKEN_ENV, "")
    with pytest.raises(TokenError, match=f"{TOKEN_ENV} is set but empty"):
        dashboard_token()
