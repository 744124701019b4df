"""hf-scratch-demo: a bad model directory gets hf-scratch-translate's own one-line message (exit 2); a missing gradio,
a bad port or device, and a Space folder that would lose files are refused before any model is loaded.

Cases that reach the model need gradio (the demo checks for it first); where gradio is not installed they expect
the install message instead, so they pass, for a documented reason, on a machine without the `[demo]` extra."""

from __future__ import annotations

import contextlib
import io
import socket
import sys
from importlib.util import find_spec
from pathlib import Path

from hostile_inputs import Case, Failure, Workspace, one_line, run_cli

CATEGORY = "demo"
GRADIO_MISSING = ("needs gradio", "pip install", "[demo]")


def run_demo(argv: list) -> tuple[int, str]:
    """hf-scratch-demo's main in this process: (exit status, stderr). Every case here fails before the server
    would start."""
    from hf_scratch_transformer.translation import demo

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = demo.main([str(a) for a in argv])
    return code, err.getvalue()


def _gradio_installed() -> bool:
    return find_spec("gradio") is not None


def _after_gradio(argv: list, code: int, *parts: str) -> str:
    """`one_line` for a case that reaches past the gradio check: its own message, or the install message."""
    if not _gradio_installed():
        return "gradio not installed, so: " + one_line(*run_demo(argv), 2, *GRADIO_MISSING)
    return one_line(*run_demo(argv), code, *parts)


# ---------------------------------------------------------------------------- bad model directories, as the CLI


def _missing(model: Path, ws: Workspace) -> Path:
    return ws.root / "outputs-that-do-not-exist" / "model"


def _a_file(model: Path, ws: Workspace) -> Path:
    return model / "config.json"


def _no_weights(model: Path, ws: Workspace) -> Path:
    (model / "model.safetensors").unlink()
    return model


def _truncated_weights(model: Path, ws: Workspace) -> Path:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return model


def _bert_config(model: Path, ws: Workspace) -> Path:
    config = model / "config.json"
    config.write_text(config.read_text().replace('"scratch_transformer"', '"bert"'))
    return model


def same_message_as_cli(name: str, damage, *parts: str) -> Case:
    """The demo refuses the damaged directory with exit 2 and the very message hf-scratch-translate gives."""
    def check(ws: Workspace) -> str:
        if not _gradio_installed():  # refused before the model: no need to train one
            return _after_gradio(["--model", ws.root / "any-model", "--port", _free_port()], 2)
        model = damage(ws.model_dir(), ws)
        demo_argv = ["--model", model, "--port", _free_port()]
        demo_message = one_line(*run_demo(demo_argv), 2, *parts)
        cli_message = one_line(*run_cli(["--model", model, "Hello."]), 2, *parts)
        if demo_message.split("error: ", 1)[1] != cli_message.split("error: ", 1)[1]:
            raise Failure(f"the demo says {demo_message!r} but hf-scratch-translate {cli_message!r}")
        return demo_message
    return Case(name, CATEGORY, check)


# --------------------------------------------------------------------------------------- checks before any work


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _without_gradio(ws: Workspace) -> str:
    """gradio made unimportable the way Python documents it (None in sys.modules): one line naming the extra."""
    saved = {name: module for name, module in sys.modules.items() if name == "gradio" or name.startswith("gradio.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["gradio"] = None
    try:
        return one_line(*run_demo(["--model", ws.root / "any-model", "--port", _free_port()]), 2, *GRADIO_MISSING)
    finally:
        del sys.modules["gradio"]
        sys.modules.update(saved)


def _port_in_use(ws: Workspace) -> str:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        return one_line(*run_demo(["--model", ws.root / "never-loaded", "--port", port]), 1, f"127.0.0.1:{port}",
                        "in use", "--port")


def _space_over_existing_app(ws: Workspace) -> str:
    space = ws.fresh("space")
    (space / "app.py").write_text("# my own app\n")
    message = one_line(*run_demo(["--write_space", space, "--model", "owner/model"]), 2, "already holds app.py",
                       "new or empty folder")
    if (space / "app.py").read_text() != "# my own app\n" or len(list(space.iterdir())) != 1:
        raise Failure(f"{space} was changed although the Space was refused")
    return message


def _space_under_a_file(ws: Workspace) -> str:
    blocker = ws.fresh("blocker") / "a-file"
    blocker.write_text("not a folder\n")
    argv = ["--write_space", blocker / "space", "--model", "owner/model"]
    return _after_gradio(argv, 1, "cannot write the Space", "a file stands where a folder is needed", str(blocker))


def plain_case(name: str, check) -> Case:
    return Case(name, CATEGORY, check)


CASES = [
    same_message_as_cli("demo_missing_model_dir", _missing, "model directory not found"),
    same_message_as_cli("demo_model_is_a_file", _a_file, "is a file, not a model directory", "config.json"),
    same_message_as_cli("demo_model_dir_without_weights", _no_weights, "no model weights", "model.safetensors"),
    same_message_as_cli("demo_truncated_weights", _truncated_weights, "truncated or corrupted"),
    same_message_as_cli("demo_config_of_a_bert", _bert_config, "'bert'", "not a translation"),
    plain_case("demo_without_gradio", _without_gradio),
    plain_case("demo_port_out_of_range", lambda ws: one_line(
        *run_demo(["--model", ws.root / "never-loaded", "--port", "70000"]), 2, "--port", "70000", "65535")),
    plain_case("demo_port_in_use", _port_in_use),
    # without --port the server tried the name on every port from 7860, one error line each, and never exited
    plain_case("demo_host_that_does_not_resolve", lambda ws: one_line(
        *run_demo(["--model", ws.root / "never-loaded", "--host", "a-name-that-does-not-resolve"]), 2,
        "--host a-name-that-does-not-resolve", "not an address")),
    plain_case("demo_host_not_of_this_machine", lambda ws: one_line(
        *run_demo(["--model", ws.root / "never-loaded", "--host", "192.0.2.1"]), 1, "cannot listen on 192.0.2.1",
        "--host")),
    plain_case("demo_unknown_device", lambda ws: one_line(
        *run_demo(["--model", ws.root / "never-loaded", "--device", "nodevice"]), 2, "--device", "'nodevice'")),
    plain_case("demo_space_of_a_local_directory", lambda ws: one_line(
        *run_demo(["--write_space", ws.root / "space", "--model", ws.root]), 2, "local path", "owner/name")),
    plain_case("demo_space_of_a_malformed_id", lambda ws: one_line(
        *run_demo(["--write_space", ws.root / "space", "--model", "owner/name/extra"]), 2, "owner/name/extra",
        "hub model id")),
    plain_case("demo_space_over_an_existing_app", _space_over_existing_app),
    plain_case("demo_space_under_a_file", _space_under_a_file),
]
