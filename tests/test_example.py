"""The README's first command: ``python -m rlt_compile.example`` compiles a tiny model and checks it."""

from rlt_compile import example


def test_example_compiles_a_tiny_model_and_its_greedy_tokens_equal_eager(capsys):
    assert example.main(["--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "compile_model, platform cpu" in out
    assert "greedy tokens equal the eager model's: yes" in out


def test_example_eager_runs_without_compiling(capsys):
    assert example.main(["--family", "nanbeige", "--eager", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "output (eager" in out and "greedy tokens equal" not in out
