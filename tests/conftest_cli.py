"""Shared fixtures for the CLI and plotting tests: a tiny model trained for a few seconds, saved to disk.

Import with `from conftest_cli import trained_model_dir, ...` (tests/ is on sys.path under pytest).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

PAIRS_EN_ES = [
    ("In the beginning God created the heavens and the earth.", "En el principio creó Dios los cielos y la tierra."),
    ("And God said, Let there be light.", "Y dijo Dios: Sea la luz."),
    ("And there was light.", "Y fue la luz."),
    ("God saw the light, that it was good.", "Y vio Dios que la luz era buena."),
    ("There was evening and there was morning.", "Y fue la tarde y la mañana."),
    ("Jesus wept.", "Jesús lloró."),
    ("The earth was without form.", "La tierra estaba desordenada."),
    ("God called the light Day.", "Dios llamó a la luz Día."),
    ("The darkness he called Night.", "A las tinieblas llamó Noche."),
    ("Let the waters bring forth.", "Produzcan las aguas."),
    ("The Lord is my shepherd.", "El Señor es mi pastor."),
    ("I shall not want.", "Nada me faltará."),
    ("Love your neighbor.", "Ama a tu prójimo."),
    ("The sea and the dry land.", "El mar y la tierra seca."),
    ("He made the stars also.", "Hizo también las estrellas."),
    ("God blessed them.", "Dios los bendijo."),
    ("Be fruitful and multiply.", "Fructificad y multiplicaos."),
    ("The man and his wife.", "El hombre y su mujer."),
    ("The tree of life.", "El árbol de la vida."),
    ("A river went out of Eden.", "Salía de Edén un río."),
    ("Where are you?", "¿Dónde estás tú?"),
    ("Am I my brother's keeper?", "¿Soy yo guarda de mi hermano?"),
    ("The water covered the earth.", "El agua cubrió la tierra."),
    ("Noah built an altar.", "Noé edificó un altar."),
    ("Peace be with you.", "La paz sea con vosotros."),
    ("The light shines in the darkness.", "La luz resplandece en las tinieblas."),
    ("God is love.", "Dios es amor."),
    ("Ask, and it will be given to you.", "Pedid, y se os dará."),
    ("Blessed are the meek.", "Bienaventurados los mansos."),
    ("The word was with God.", "El verbo era con Dios."),
]


def _build_tokenizer(texts, vocab_size=320):
    from hf_scratch_transformer.tokenization import train_bpe_tokenizer

    return train_bpe_tokenizer(texts, vocab_size=vocab_size, model_max_length=64)


def train_tiny_model(steps: int = 100, seed: int = 0, lr: float = 3e-3):
    """(model, tokenizer): the "tiny" preset, trained on PAIRS_EN_ES until it mostly reproduces them (~3 s)."""
    import hf_scratch_transformer  # noqa: F401
    from transformers import GenerationConfig

    from hf_scratch_transformer import ScratchTransformerConfig, ScratchTransformerForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = _build_tokenizer([text for pair in PAIRS_EN_ES for text in pair])
    config = ScratchTransformerConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), dropout=0.0, max_position_embeddings=64
    )
    model = ScratchTransformerForConditionalGeneration(config)
    sources, targets = zip(*PAIRS_EN_ES)
    batch = tokenizer(list(sources), text_target=list(targets), padding=True, return_tensors="pt")
    labels = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster than several fighting over busy cores
    try:
        for _ in range(steps):
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_length=32
    )
    model.final_loss = loss.item()
    return model, tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matrices on shared cores: one torch thread is much faster than two spinning against each other.

    Autouse in every test module that imports it; the previous thread count is restored afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_TRAINED: dict = {}  # test modules that import the fixture each get their own copy of it; train only once


@pytest.fixture(scope="session")
def trained_model(tmp_path_factory):
    """(model, tokenizer, saved directory) of a tiny model trained a few hundred steps on PAIRS_EN_ES."""
    if not _TRAINED:
        model, tokenizer = train_tiny_model()
        directory = tmp_path_factory.mktemp("tiny_translation_model")
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        _TRAINED["value"] = (model, tokenizer, directory)
    return _TRAINED["value"]


@pytest.fixture(scope="session")
def trained_model_dir(trained_model):
    return trained_model[2]


def run_cli(*args, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `python -m hf_scratch_transformer.cli ARGS` in a fresh process, from the repository root."""
    return start_cli(*args, stdin=stdin).result(timeout)


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG read from its header; fails the test if the file is not a PNG."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def start_cli(*args, stdin: str | None = None) -> "CliRun":
    """Start `python -m hf_scratch_transformer.cli ARGS` without waiting, so that runs overlap (each one spends
    seconds importing torch and transformers). One torch thread each: the model is tiny and the cores are shared."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_scratch_transformer.cli", *map(str, args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
        cwd=REPO_ROOT, env=env,
    )
    return CliRun(process, stdin)


class CliRun:
    """A started CLI process; `.result()` waits once and returns a CompletedProcess."""

    def __init__(self, process: subprocess.Popen, stdin: str | None):
        self.process, self.stdin, self._result = process, stdin, None

    def result(self, timeout: float = 180) -> subprocess.CompletedProcess:
        if self._result is None:
            stdout, stderr = self.process.communicate(self.stdin, timeout=timeout)
            self._result = subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout, stderr)
        return self._result
