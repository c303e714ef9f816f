"""``python -m services.ingest``'s start-up checks that end it with status 2 and one line,
before anything is created on Kafka (no broker is needed here: none is reached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.ingest.__main__ import main
from services.ingest.tenants import hash_api_key


def test_a_tokenizer_file_that_cannot_be_read_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It used to be read after the topics were made, and end in a FileNotFoundError
    traceback."""
    missing = tmp_path / "tokenizer.json"
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f"""
[models.my-model]
num_layers = 2
num_kv_heads = 2
head_dim = 64
max_model_len = 4096
tokenizer = "{missing}"

[tenants.acme]
api_key_sha256 = "{hash_api_key('k')}"
rpm = 60
tpm = 1000
max_concurrency = 2
""")
    # Nothing listens here: reaching Kafka would fail differently (status 1, "cannot create").
    monkeypatch.setenv("LLMQ_KAFKA_BOOTSTRAP", "127.0.0.1:9")
    assert main(["--tenants-file", str(tenants)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ingest: invalid configuration: a models.<name>.tokenizer file")
    assert str(missing) in err and len(err.splitlines()) == 1
    missing.write_bytes(b"\xff\xfe not utf-8")
    assert main(["--tenants-file", str(tenants)]) == 2
    assert "tokenizer file cannot be read" in capsys.readouterr().err
