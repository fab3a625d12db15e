"""``python -m rlt_compile.inspect`` on a tiny checkpoint: depyf dump, FX graphs before/after our
passes, pass logs and Inductor code, plus the depyf / torch 2.13 shim."""

from __future__ import annotations

import inspect

import pytest

from rlt_compile import depyf_compat
from rlt_compile.inspect import main


def test_depyf_shim_accepts_torchs_new_keyword():
    pytest.importorskip("depyf")
    if not depyf_compat.needs_shim() and not depyf_compat._installed:
        pytest.skip("this torch / depyf pair needs no shim")
    assert depyf_compat.install()
    from depyf.explain import enable_debugging

    params = inspect.signature(enable_debugging.patched_load_by_key_path).parameters
    assert "kwargs" in params  # forwards set_sys_modules=... to torch's load_by_key_path


def test_inspect_dumps_everything(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "dump"
    assert main(["--model", str(tiny_dirs["ouro"]), "--out", str(out), "--platform", "cpu", "--decode-steps", "1"]) == 0
    summary = (out / "SUMMARY.md").read_text()
    assert "Dynamo graphs per unit: {'embed': 1, 'loop_step': 1, 'head': 1}" in summary
    assert "attention_swap: 2 nodes rlt.attention -> rlt.attention_torch" in summary
    assert summary in capsys.readouterr().out
    for unit in ("embed", "loop_step", "head"):
        for suffix in ("before.txt", "after.txt", "before.py", "after.py", "passes.txt", "inductor.py"):
            assert (out / f"{unit}.0.{suffix}").is_file(), f"{unit}.0.{suffix}"
    assert "rlt.attention(" in (out / "loop_step.0.before.txt").read_text()
    after = (out / "loop_step.0.after.txt").read_text()
    assert "rlt.attention_torch(" in after and "rlt.attention(" not in after
    assert "torch.ops.rlt.attention_torch.default(" in (out / "loop_step.0.inductor.py").read_text()
    depyf_dir = out / "depyf"
    assert list(depyf_dir.glob("full_code_for_loop_step*.py"))
    assert list(depyf_dir.glob("__transformed_code_*_for_loop_step.py"))
    assert list(depyf_dir.glob("__compiled_fn_*kernel_*.py"))  # Inductor code through depyf (needs the shim)


def test_inspect_reports_bad_arguments(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--platform", "cpu"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["--model", "tiny:ouro", "--out", str(tmp_path / "o"), "--platform", "tpu"]) == 2
    assert "unknown platform 'tpu'" in capsys.readouterr().err
