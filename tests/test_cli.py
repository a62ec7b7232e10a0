import json

import pytest
import torch

from griffin import CausalLM, ModelConfig, generate, load_pretrained, save_pretrained
from griffin.cli import main
from tests.conftest import perturb_, seed_torch


def test_presets_table(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "griffin-14b" in out and "recurrentgemma-2b" in out and "2,682,862,080" in out


def test_convert_between_all_formats(tmp_path, gen, capsys):
    cfg = ModelConfig.from_preset("griffin-tiny", embed_scale=True, logits_soft_cap=30.0, gate_blocks=2,
                                  conv1d_document_reset=False)
    model = CausalLM(cfg)
    perturb_(model, gen)
    save_pretrained(model, tmp_path / "g")
    ids = torch.randint(0, 32, (1, 25), generator=gen)
    expected = model.eval()(ids)
    assert main(["convert", str(tmp_path / "g"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    # HF semantics (no Conv1D reset at document starts) cannot be expressed by the official model: refused, or lossy
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "o.pt"), "--to", "official"]) == 2
    assert "cannot be expressed as an official recurrentgemma model" in capsys.readouterr().err
    assert not (tmp_path / "o.pt").exists()
    with pytest.warns(UserWarning, match="lossy official checkpoint"):
        assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "o.pt"), "--to", "official", "--lossy"]) == 0
    assert main(["convert", str(tmp_path / "o.pt"), str(tmp_path / "back"), "--window", "5"]) == 0
    back = load_pretrained(tmp_path / "back")
    assert back.config.attention_window == 6  # official window 5 = 6 keys seen
    torch.testing.assert_close(load_pretrained(tmp_path / "hf")(ids), expected)
    assert main(["info", str(tmp_path / "hf")]) == 0
    assert "format: hf" in capsys.readouterr().out


def test_official_conversion_round_trips(tmp_path, gen):
    """griffin -> official -> griffin keeps every setting the weights do not hold (window, embedding scale, soft-cap:
    in the official GriffinConfig fields beside the .pt) and the logits."""
    cfg = ModelConfig.from_preset("griffin-tiny", gate_blocks=2, attention_window=9)  # no embed scale, no soft-cap
    model = CausalLM(cfg).eval()
    perturb_(model, gen)
    save_pretrained(model, tmp_path / "g")
    assert main(["convert", str(tmp_path / "g"), str(tmp_path / "o.pt"), "--to", "official"]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["attention_window_size"] == 8
    assert main(["convert", str(tmp_path / "o.pt"), str(tmp_path / "back")]) == 0
    back = load_pretrained(tmp_path / "back")
    assert back.config.replace(name="") == cfg.replace(name="")
    ids = torch.randint(0, 32, (1, 25), generator=gen)
    torch.testing.assert_close(back(ids), model(ids))


def test_convert_reports_errors(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert"])


def test_generate_command(tmp_path, gen, capsys):
    seed_torch(gen)
    model = CausalLM(ModelConfig.from_preset("griffin-tiny", vocab_size=256))
    save_pretrained(model, tmp_path / "m")
    base = ["generate", str(tmp_path / "m"), "--tokenizer", "bytes", "--max-new-tokens", "6", "--temperature", "0"]
    assert main([*base, "--prompt", "hello"]) == 0
    out = capsys.readouterr().out
    expected = bytes(generate(model, [list(b"hello")], 6, temperature=0)[0]).decode("utf-8", "replace")
    assert out == "hello" + expected + "\n"
    # A snapshot after a prompt, continued later, gives the continuation of prompt + continuation.
    assert main([*base, "--prompt", "hel", "--max-new-tokens", "0", "--save-state", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    assert main([*base, "--prompt", "lo", "--load-state", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out == "lo" + expected + "\n"
    (tmp_path / "prompts.txt").write_text("ab\ncd\n")
    assert main([*base, "--prompt-lines", str(tmp_path / "prompts.txt")]) == 0
    assert capsys.readouterr().out.count("-" * 40) == 2
    # --prompt-file: the whole file is one prompt, so a book of many lines can be saved as one state
    assert main([*base, "--prompt-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "0",
                 "--save-state", str(tmp_path / "book")]) == 0
    assert "saved the state after 6 tokens" in capsys.readouterr().err  # BOS-less bytes: "ab\ncd\n"
    assert main([*base, "--prompt-file", str(tmp_path)]) == 2
    assert f"--prompt-file {tmp_path} is a directory" in capsys.readouterr().err
    assert main([*base, "--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p=0.0" in capsys.readouterr().err
    assert main([*base, "--prompt", "a", "--prompt", "b", "--save-state", str(tmp_path / "s2")]) == 2
    assert "save_state needs a single prompt, not 2" in capsys.readouterr().err
    assert not (tmp_path / "s2").exists()


def test_generate_compiled_gives_the_same_greedy_text(tmp_path, gen, capsys):
    seed_torch(gen)
    save_pretrained(CausalLM(ModelConfig.from_preset("griffin-tiny", vocab_size=256)), tmp_path / "m")
    base = ["generate", str(tmp_path / "m"), "--tokenizer", "bytes", "--max-new-tokens", "12", "--temperature", "0",
            "--prompt", "hello"]
    assert main(base) == 0
    eager = capsys.readouterr().out
    assert main([*base, "--compile"]) == 0
    assert capsys.readouterr().out == eager


def test_tokenizer_and_prepare_commands(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "griffin hawk local attention " * (20 + i))
    (corpus / "more.jsonl").write_text('{"text": "a record"}\n{"text": "another record"}\n')
    assert main(["tokenizer", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "tok")]) == 0
    assert str(tmp_path / "tok" / "tokenizer.json") in capsys.readouterr().out
    assert main(["prepare", str(corpus), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "data"),
                 "--val-fraction", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "val:" in out
    # 8 documents, fewer than 50: cut into pieces, so that the held-out fifth is of pieces, not of whole files
    splits = json.loads((tmp_path / "data" / "meta.json").read_text())["splits"]
    pieces = splits["train"]["documents"] + splits["val"]["documents"]
    assert pieces > 8 and splits["val"]["documents"] == round(pieces * 0.2)
    assert main(["prepare", str(tmp_path / "data" / "meta.json"), "--out", str(tmp_path / "d3")]) == 2
    assert "is the meta file of a dataset prepared by `griffin prepare`" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "d2")]) == 2
    assert "missing" in capsys.readouterr().err


def test_two_files_do_not_put_a_whole_file_in_validation(tmp_path, capsys):
    """Two files, one a tenth of the other: at the default val fraction the held-out split is a few pieces (about
    2% of the tokens), not the small file or the big one (before: one of the two whole files)."""
    (tmp_path / "a.txt").write_text("".join(f"line {i} of the long file\n" for i in range(2000)))
    (tmp_path / "b.txt").write_text("".join(f"line {i} of the short one\n" for i in range(200)))
    assert main(["prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--out", str(tmp_path / "data")]) == 0
    splits = json.loads((tmp_path / "data" / "meta.json").read_text())["splits"]
    share = splits["val"]["tokens"] / (splits["val"]["tokens"] + splits["train"]["tokens"])
    assert 0 < share < 0.05, splits


def test_info_names_int8_weights_and_points_from_a_run_to_its_checkpoint(tmp_path, gen, capsys):
    seed_torch(gen)
    save_pretrained(CausalLM(ModelConfig.from_preset("griffin-tiny", vocab_size=256)), tmp_path / "run" / "checkpoints"
                    / "step_00000002")
    (tmp_path / "run" / "checkpoints" / "best").symlink_to("step_00000002")
    assert main(["info", str(tmp_path / "run")]) == 2
    assert f"griffin info {tmp_path / 'run' / 'checkpoints' / 'best'}" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "run" / "checkpoints" / "best"), str(tmp_path / "q"), "--int8"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "q")]) == 0
    assert "int8 weights, one scale per output channel; the rest float32" in capsys.readouterr().out


def test_existing_outputs_are_replaced_only_with_overwrite(tmp_path, gen, capsys):
    seed_torch(gen)
    save_pretrained(CausalLM(ModelConfig.from_preset("griffin-tiny", vocab_size=256)), tmp_path / "m")
    (tmp_path / "text.txt").write_text("".join(f"line {i}\n" for i in range(300)))
    commands = {  # each writes its output once, is refused the second time, and replaces it with --overwrite
        "prepare": ["prepare", str(tmp_path / "text.txt"), "--out", str(tmp_path / "data")],
        "quantize": ["quantize", str(tmp_path / "m"), str(tmp_path / "q"), "--int8"],
        "convert": ["convert", str(tmp_path / "m"), str(tmp_path / "copy")],
        "tokenizer": ["tokenizer", str(tmp_path / "text.txt"), "--vocab-size", "260", "--out", str(tmp_path / "tok")],
    }
    for name, argv in commands.items():
        assert main(argv) == 0, name
        capsys.readouterr()
        assert main(argv) == 2, name
        assert "pass --overwrite to replace it" in capsys.readouterr().err, name
        assert main([*argv, "--overwrite"]) == 0, name
        capsys.readouterr()


OPENMP_PROGRAM = """
import os, sys
import griffin, griffin.cli
before = "torch" in sys.modules
griffin.cli.main(["presets"])
print(before, os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize("given, expected", [(None, "passive"), ("active", "active")])
def test_the_command_lets_openmp_threads_sleep_before_torch_loads(given, expected):
    """`griffin` sets OMP_WAIT_POLICY=passive (the user's own setting wins) before torch is imported (torch's OpenMP
    runtime reads it once, on loading): neither `import griffin` nor `import griffin.cli` imports torch."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    done = subprocess.run([sys.executable, "-c", OPENMP_PROGRAM], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == f"False {expected}"


# The CLI explains itself (issue 13) ------------------------------------------------------------------------------
OWN_COMMANDS = ("presets", "convert", "quantize", "generate", "train", "prepare", "tokenizer", "info")


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def test_version_and_main_help(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"griffin {version('griffin')}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Griffin and Hawk" in out and "``" not in out  # a description, not the module's raw docstring
    assert "examples:" in out and "griffin train --out runs/hawk --resume" in out and "exit status:" in out
    for name in OWN_COMMANDS:  # each sub-command listed with its help
        assert f"    {name}" in out


def test_every_subcommand_has_a_description_and_plain_help(capsys):
    from griffin.cli import EXAMPLES, build_parser

    def walk(parser, path):
        yield path, parser
        for name, sub in _subparsers(parser).items():
            yield from walk(sub, [*path, name])

    seen = set()
    for path, parser in walk(build_parser(), []):
        if not path or id(parser) in seen:  # aliases share a parser
            continue
        seen.add(id(parser))
        assert parser.description, path
        text = parser.format_help()
        assert "``" not in text and ":func:" not in text and ":class:" not in text, path
        if len(path) == 1 and path[0] in EXAMPLES:
            assert "examples:\n  griffin " + path[0] in text, path
    assert {"synth", "eval", "plan", "serve"} <= {p[0] for p in ([n] for n in _subparsers(build_parser()))}


def test_own_options_have_help_and_show_defaults():
    from griffin.cli import build_parser

    commands = _subparsers(build_parser())
    for name in OWN_COMMANDS:
        for action in commands[name]._actions:
            assert action.help and action.help.strip(), (name, action.option_strings or action.dest)
    generate = commands["generate"].format_help()
    assert "tokens to generate after each prompt (default: 64)" in " ".join(generate.split())
    assert "(default: None)" not in generate and "(default: False)" not in generate
    train = " ".join(commands["train"].format_help().split())
    assert "--lr LR peak learning rate (default: 0.003)" in train
    assert "--debug" in train  # the global flag is also accepted after the sub-command


def test_mistyped_names_get_suggestions(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["trian"])
    assert exit_.value.code == 2 and "invalid choice: 'trian'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trian"])
    assert "did you mean train?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "ckpt", "--dtype", "bfloat61"])
    assert "did you mean bfloat16 or float64 or float16?" in capsys.readouterr().err  # closest first, of --dtype's
    assert main(["info", "griffin-tny"]) == 2
    assert "no preset or checkpoint named 'griffin-tny'; did you mean griffin-tiny" in capsys.readouterr().err
    assert main(["train", "--preset", "hawk-cpuu", "--out", str(tmp_path / "run")]) == 2
    assert "unknown preset 'hawk-cpuu'; did you mean ['hawk-cpu'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# The error policy ------------------------------------------------------------------------------------------------
def test_user_errors_and_bugs_are_told_apart():
    from griffin.cli import is_user_error
    from griffin.interop import CheckpointError
    from griffin.io import FileFormatError
    from griffin.training import TrainingError
    from griffin.training.config import ConfigTypeError

    for err in (ValueError("v"), FileNotFoundError(2, "x"), FileExistsError(17, "x"), NotADirectoryError(),
                IsADirectoryError(), PermissionError(), OSError(), CheckpointError("c"), FileFormatError("f"),
                TrainingError("t"), ConfigTypeError("lr='fast'")):
        assert is_user_error(err), err
    for err in (TypeError("t"), KeyError("k"), AttributeError("a"), RuntimeError("r"), AssertionError()):
        assert not is_user_error(err), err


def _failing(monkeypatch, exc):
    import griffin.cli

    def cmd(args):
        raise exc

    monkeypatch.setattr(griffin.cli, "cmd_presets", cmd)


def test_a_user_error_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    _failing(monkeypatch, FileExistsError(17, "File exists", "out/model"))
    assert main(["presets"]) == 2
    assert capsys.readouterr().err == "griffin presets: error: out/model: File exists\n"
    for argv in (["--debug", "presets"], ["presets", "--debug"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and err.endswith("griffin presets: error: out/model: File exists\n")


def test_a_bug_keeps_its_traceback(monkeypatch):
    _failing(monkeypatch, TypeError("unsupported operand"))
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["presets"])


def test_interrupt_and_broken_pipe(monkeypatch, capsys):
    _failing(monkeypatch, KeyboardInterrupt())
    assert main(["presets"]) == 130
    assert capsys.readouterr().err == "\ngriffin presets: interrupted\n"
    _failing(monkeypatch, BrokenPipeError(32, "Broken pipe"))
    assert main(["presets"]) == 141
    assert capsys.readouterr().err == ""


def test_first_ctrl_c_restores_the_default_handler():
    """The first SIGINT raises KeyboardInterrupt and puts the default handler back, so a second one stops the
    process at once; main() leaves the handler as it found it."""
    import os
    import signal

    from griffin.cli import _install_interrupt_handler

    original = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        restore = _install_interrupt_handler()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # Python runs the handler between bytecodes of the main thread
                pass
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, original)


def test_every_option_of_every_command_has_help():
    """Sub-commands added by other packages (serve, synth, eval, plan) and their own sub-commands included."""
    import argparse

    from griffin.cli import build_parser

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, (*path, name))
            else:
                yield path, action

    seen = set()
    for path, action in walk(build_parser(), ()):
        seen.add(path[:1])
        assert action.help and action.help.strip(), (" ".join(path), action.option_strings or action.dest)
    assert {("serve",), ("synth",), ("eval",), ("plan",)} <= seen
