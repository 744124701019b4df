"""What the tests share besides fixtures (those are in conftest.py): sentence pairs, the tiny-model training
recipe, train.py flags of a tiny run, and running the command line in a fresh process.

Test files import it as `from helpers import ...` (pytest puts tests/ on sys.path: it has no __init__.py).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig

from hf_scratch_transformer import ScratchTransformerConfig, ScratchTransformerForConditionalGeneration
from hf_scratch_transformer.training.arguments import flags_to_argv, parse_arguments
from hf_scratch_transformer.data.tokenization import train_bpe_tokenizer
from hf_scratch_transformer.training.run import main, run_training

REPO = Path(__file__).resolve().parents[1]
MODEL_CARD_TEMPLATE = REPO / "model_card.md"

# A handful of pairs: the `pairs` / `tiny_tokenizer` fixtures, exact checks of the model.
PAIRS = [
    ("In the beginning God created the heavens and the earth.", "En el principio creó Dios los cielos y la tierra."),
    ("And God said, Let there be light.", "Y dijo Dios: Sea la luz."),
    ("The earth was without form.", "Y la tierra estaba desordenada."),
    ("God saw the light, that it was good.", "Y vio Dios que la luz era buena."),
    ("There was evening and there was morning.", "Y fue la tarde y la mañana."),
    ("Jesus wept.", "Y lloró Jesús."),
]

CORPUS_PAIRS = PAIRS * 4  # a small corpus file's pairs (write_jsonl(path, pair_records()))

# Thirty short pairs: what the session's trained model (`trained_model` fixture) learns to reproduce.
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

# The `corpus_tokenizer` fixture: trained on the first pairs of the shipped corpus.
TOKENIZER_TRAIN_PAIRS = 3000
TOKENIZER_VOCAB_SIZE = 1000


def build_tiny_tokenizer(texts, vocab_size=400):
    """The package's byte-level BPE, trained on a few sentences: ids <pad>=0 <s>=1 </s>=2 <unk>=3."""
    return train_bpe_tokenizer(texts, vocab_size=vocab_size, model_max_length=64)


GENERATION = dict(decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # the tiny tokenizer's ids


def model_to_compare_decodings(pairs, tokenizer):
    """A tiny model trained briefly on the pairs, saved for beam search as train.py saves (num_beams 4,
    early_stopping, max_new_tokens 47): confident, non-degenerate outputs to compare decodings on."""
    from transformers import GenerationConfig

    model, _ = train_on_pairs(pairs, tokenizer, steps=60)
    model.generation_config = GenerationConfig(**GENERATION, max_new_tokens=47, num_beams=4, early_stopping=True)
    return model


def train_on_pairs(pairs, tokenizer, steps: int, lr: float = 3e-3, seed: int = 0, **config_overrides):
    """(model in eval mode, last loss): the "tiny" preset without dropout, trained full-batch with Adam on `pairs`
    (teacher-forced, padding ignored) for `steps` steps."""
    torch.manual_seed(seed)
    config = ScratchTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), dropout=0.0, **config_overrides)
    model = ScratchTransformerForConditionalGeneration(config)
    sources, targets = zip(*pairs)
    batch = tokenizer(list(sources), text_target=list(targets), padding=True, return_tensors="pt")
    labels = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), loss.item()


def train_tiny_model(steps: int = 100, seed: int = 0, lr: float = 3e-3):
    """(model, tokenizer): the "tiny" preset, trained on PAIRS_EN_ES until it mostly reproduces them (~3 s)."""
    tokenizer = build_tiny_tokenizer([text for pair in PAIRS_EN_ES for text in pair], vocab_size=320)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster than several fighting over busy cores
    try:
        model, loss = train_on_pairs(PAIRS_EN_ES, tokenizer, steps, lr=lr, seed=seed, max_position_embeddings=64)
    finally:
        torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_length=32
    )
    model.final_loss = loss
    return model, tokenizer


def attention_mask_probe(model) -> dict:
    """One tiny batch through `model` in the caller's context (autocast, gradients), the same batch on every call: its
    loss, and its logits as they are, with the last target token changed and with a padded source position changed.
    Row 0's source is padded after 5 tokens; the decoder input has no padding (sdpa gets no causal mask then)."""
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(4, 99, (3, 7), generator=generator)
    labels = torch.randint(4, 99, (3, 5), generator=generator)
    source_mask = torch.ones_like(source)
    source_mask[0, 5:] = 0
    decoder_input = model.prepare_decoder_input_ids_from_labels(labels)
    later, padding = decoder_input.clone(), source.clone()
    later[:, -1], padding[0, 5:] = 98, 97

    def logits(input_ids, decoder_input_ids):
        return model(input_ids=input_ids, attention_mask=source_mask, decoder_input_ids=decoder_input_ids).logits

    return {"loss": model(input_ids=source, attention_mask=source_mask, labels=labels).loss,
            "logits": logits(source, decoder_input), "later_token": logits(source, later),
            "padded_position": logits(padding, decoder_input)}


def assert_the_masks_hide_what_they_must(probe: dict) -> None:
    """A later target token changes only its own position's logits; a padded source position changes none."""
    before, later = probe["logits"], probe["later_token"]
    assert torch.equal(later[:, :-1], before[:, :-1]) and not torch.equal(later, before)
    assert torch.equal(probe["padded_position"], before)


def tiny_run_flags(output_dir, **overrides) -> list[str]:
    """train.py flags of a tiny run: ~400 training pairs, small vocabulary, short evaluation; finishes in seconds.
    A value of None drops the flag, True gives it without a value. fp32 is pinned, so that a run is the same on
    every CPU (the default precision depends on the CPU's bf16 units: test_arguments.py tests that rule)."""
    flags = {
        "preset": "tiny", "output_dir": str(output_dir), "max_train_samples": 400, "max_eval_samples": 16,
        "max_predict_samples": 16, "tokenizer_vocab_size": 600, "max_tokens": 1024, "max_source_length": 96,
        "max_target_length": 96, "max_steps": 8, "logging_steps": 2, "save_steps": 4, "eval_steps": 4,
        "warmup_steps": 4, "eval_max_new_tokens": 12, "num_beams": 2, "report_to": "none",
        "max_position_embeddings": 128, "bf16": False,
    }
    flags.update(overrides)
    return flags_to_argv(flags)


# -------------------------------------------------------------------------------------------- train.py runs
def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")
    return path


def pair_records(pairs=CORPUS_PAIRS):
    return [{"translation": {"en": en, "es": es}} for en, es in pairs]


def fails_with(argv, capsys, code=2):
    """Run train.py's main in-process; check the exit code and that stderr ends in one line; return that line."""
    assert main(argv, MODEL_CARD_TEMPLATE) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def saved_files(directory):
    """What a user could lose: every non-hidden entry of the directory."""
    return sorted(path.name for path in directory.iterdir() if not path.name.startswith(".")) if directory.exists() else []


def digests(directory):
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in directory.iterdir() if path.is_file()}


# Smaller than tiny_run_flags' defaults: these tests check the mechanics, not what the model learns.
QUICK = dict(max_train_samples=80, max_eval_samples=4, max_predict_samples=2, num_beams=1, eval_max_new_tokens=4,
             max_tokens=512)


def quick_flags(output_dir, **overrides) -> list[str]:
    return tiny_run_flags(output_dir, **{**QUICK, **overrides})


def run_quick(output_dir, **overrides) -> dict:
    return run_training(*parse_arguments(quick_flags(output_dir, **overrides)), MODEL_CARD_TEMPLATE)


def run_tiny(output_dir, **overrides) -> dict:
    return run_training(*parse_arguments(tiny_run_flags(output_dir, **overrides)), MODEL_CARD_TEMPLATE)


# ------------------------------------------------------------------------------------------------ command line


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG read from its header; fails the test if the file is not a PNG."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def run_cli(*args, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `python -m hf_scratch_transformer.translation.cli ARGS` in a fresh process, from the repository root."""
    return start_cli(*args, stdin=stdin).result(timeout)


def start_cli(*args, stdin: str | None = None) -> "CliRun":
    """Start `python -m hf_scratch_transformer.translation.cli ARGS` without waiting, so that runs overlap (each one spends
    seconds importing torch and transformers). One torch thread each: the model is tiny and the cores are shared."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_scratch_transformer.translation.cli", *map(str, args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
        cwd=REPO, env=env,
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
