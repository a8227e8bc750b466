"""Notebooks run top to bottom (nbclient), so they can't rot; each one's outputs are checked.

They run at small sizes (`JAXLLM_NOTEBOOK_SIZE=small`, read by the notebooks themselves).
A notebook that reports figures prints one line `CHECKS {json}` that the test asserts on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def _texts(nb) -> list[str]:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if o.get("output_type") == "stream":
                out.append(o.get("text", ""))
            elif "data" in o:
                out.append(o["data"].get("text/plain", ""))
    return out


def _checks(nb) -> dict:
    lines = [line for text in _texts(nb) for line in text.splitlines() if line.startswith("CHECKS ")]
    assert len(lines) == 1, "the notebook prints one CHECKS line"
    return json.loads(lines[0][len("CHECKS ") :])


def _has_image(nb) -> bool:
    return any(
        "image/png" in o.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.get("outputs", [])
    )


def check_quickstart(nb) -> None:
    assert any("Paris" in t for t in _texts(nb))


def check_sampling_comparison(nb) -> None:
    c = _checks(nb)
    assert c["rows"] == c["expected_rows"] > 0
    assert {"greedy", "T=1.0", "top-p 0.9", "min-p 0.1", "typical 0.9", "DRY", "XTC"} <= set(c["samplers"])
    assert c["greedy_same_across_seeds"] and c["scores_in_range"]
    # Greedy takes the likeliest token at every step; sampling at T=1 cannot be likelier.
    assert c["greedy_nll"] < c["t1_nll"]
    assert _has_image(nb), "the frontier plot"


def check_state(nb) -> None:
    c = _checks(nb)
    assert c["fork_matches_fresh"] and c["rewind_matches_fresh"] and c["reload_matches_fresh"]
    assert c["n_layers"] == len(c["hidden_norms"]) and all(n > 0 for n in c["hidden_norms"])
    assert c["logit_lens_last_matches_model"]
    assert abs(c["attention_row_sum"] - 1) < 1e-3
    assert _has_image(nb)


CHECKS = {
    "quickstart.ipynb": check_quickstart,
    "sampling_comparison.ipynb": check_sampling_comparison,
    "state.ipynb": check_state,
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, monkeypatch) -> None:
    monkeypatch.setenv("JAXLLM_NOTEBOOK_SIZE", "small")  # the kernel inherits the environment
    # The kernel imports the jaxllm of this checkout, not whichever one is installed.
    root = str(Path(__file__).parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert path.name in CHECKS, f"{path.name} needs a check of its outputs here"
    CHECKS[path.name](nb)
