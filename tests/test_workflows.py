"""Workflows a transformers user expects: bounded evaluation, fine-tuning a saved model, evaluate/predict without
training, run_translation.py's result files, pipeline reuse, local paths, quiet runs and LoRA."""

import contextlib
import copy
import io
import json
import logging
import math
import re
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import MODEL_CARD_TEMPLATE, PAIRS_EN_ES, tiny_run_flags
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig, pipeline

from hf_scratch_transformer import ScratchTransformerForConditionalGeneration, TranslationPipeline, translation_pipeline
from hf_scratch_transformer.translation import cli
from hf_scratch_transformer.translation_core import TorchBackend
from hf_scratch_transformer.training.run_directory import RUN_STATE_FILE
from hf_scratch_transformer.training.run import main
from hf_scratch_transformer.translation.translate import ModelLoadError, load_model_and_tokenizer, translate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SOURCES = ["Jesus wept.", "In the beginning God created the heavens and the earth, and the earth was without form.",
           "God is love."]


TEST_SOURCES = ["Jesus wept.", "God is love.", "The light shines.", "Where are you?", "The Lord is my shepherd.",
                "And there was evening.", "God saw the earth, that it was good."]


def write_corpus(directory) -> dict:
    """Short sentence pairs the session's tiny model knows, as train/validation/test JSON lines files."""
    references = [es for _, es in PAIRS_EN_ES[: len(TEST_SOURCES)]]  # any Spanish: only the order is checked
    splits = {"train": PAIRS_EN_ES, "validation": PAIRS_EN_ES[:6], "test": list(zip(TEST_SOURCES, references))}
    files = {}
    for split, pairs in splits.items():
        files[f"{split}_file"] = directory / f"{split}.jsonl"
        files[f"{split}_file"].write_text("".join(json.dumps({"translation": {"en": en, "es": es}}) + "\n"
                                                  for en, es in pairs), encoding="utf-8")
    return files


def finetune_flags(output_dir, model_dir, **overrides) -> list[str]:
    """A short run of train.py on a few short pairs that starts from the session's tiny model (64 positions)."""
    flags = dict(model_name_or_path=str(model_dir), preset=None, max_position_embeddings=None,
                 tokenizer_vocab_size=None, max_source_length=40, max_target_length=40, max_train_samples=None,
                 max_eval_samples=None, max_predict_samples=None, max_tokens=400, max_steps=2, save_steps=2,
                 eval_steps=0, warmup_steps=1, **write_corpus(Path(output_dir).parent))
    flags.update(overrides)
    return tiny_run_flags(output_dir, **flags)


# --------------------------------------------------------------------------------------------- bounded decoding


@pytest.fixture
def endless_model(trained_model):
    """The session's tiny model, forbidden to emit </s>: it stops only where a length limit stops it."""
    model, tokenizer, _ = trained_model
    endless = copy.deepcopy(model)
    endless.generation_config = GenerationConfig(
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_new_tokens=40,
        suppress_tokens=[2],
    )
    return endless, tokenizer


def generate_ids(model, tokenizer, texts, **options) -> list[list[int]]:
    """The token ids of each text's translation, through the package's translation core."""
    return [found[0].token_ids for found in translate(model, tokenizer, texts, num_return_sequences=1, **options)]


@pytest.mark.parametrize("num_beams", [1, 2])
def test_decoding_stops_at_a_times_source_length_plus_b(endless_model, num_beams):
    model, tokenizer = endless_model
    lengths = [len(ids) for ids in tokenizer(SOURCES)["input_ids"]]
    one_by_one = generate_ids(model, tokenizer, SOURCES, batch_size=1, num_beams=num_beams, max_len_a=0.5, max_len_b=2)
    assert [len(ids) for ids in one_by_one] == [math.ceil(0.5 * n + 2) for n in lengths]
    # In one batch each sentence keeps its own bound: the same translations as one at a time.
    batched = generate_ids(model, tokenizer, SOURCES, batch_size=8, num_beams=num_beams, max_len_a=0.5, max_len_b=2)
    assert batched == one_by_one
    capped = generate_ids(model, tokenizer, SOURCES, batch_size=1, max_new_tokens=5, max_len_a=3, max_len_b=10)
    assert {len(ids) for ids in capped} == {5}
    default = generate_ids(model, tokenizer, SOURCES, batch_size=4)  # the default bound: 1.5 * source + 10
    assert [len(ids) for ids in default] == [min(math.ceil(1.5 * n + 10), 40) for n in lengths]
    unbounded = generate_ids(model, tokenizer, SOURCES, batch_size=1, max_len_a=0, max_len_b=0)
    assert {len(ids) for ids in unbounded} == {40}


def test_the_command_line_bounds_translations_by_default(trained_model_dir, monkeypatch, capsys):
    asked = []  # (source tokens, bound on new tokens) of every decoding call (one sentence each)
    original = TorchBackend.generate

    def generate(self, source_ids, bounds, *args, **kwargs):
        asked.append((len(source_ids[0]), bounds[0]))
        return original(self, source_ids, bounds, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "generate", generate)
    assert cli.main(["--model", str(trained_model_dir), "Jesus wept."]) == 0
    assert cli.main(["--model", str(trained_model_dir), "--max_len_a", "2", "--max_len_b", "1", "Jesus wept."]) == 0
    assert cli.main(["--model", str(trained_model_dir), "--max_len_a", "0", "--max_len_b", "0", "Jesus wept."]) == 0
    (length, default), (same, custom), (_, off) = asked
    assert length == same
    assert default == math.ceil(1.5 * length + 10) and custom == 2 * length + 1
    assert off == 31  # no bound: the saved generation_config's max_length (32) less the decoder start token
    assert "error" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------- fine-tuning and do_predict


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def finetuned_run(tmp_path_factory, trained_model_dir):
    """train.py started from the session's tiny model with a learning rate too small to move the weights: (output
    directory, log messages, stderr)."""
    output_dir = tmp_path_factory.mktemp("finetuned") / "out"
    records, stderr = Records(), io.StringIO()
    root = logging.getLogger()
    root.addHandler(records)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stderr(stderr):
            code = main(finetune_flags(output_dir, trained_model_dir, learning_rate=1e-12, dropout=0.2, save_steps=1),
                        MODEL_CARD_TEMPLATE)
    finally:
        root.removeHandler(records)
        root.setLevel(level)
    assert code == 0, stderr.getvalue()[-2000:]
    return output_dir, records.messages, stderr.getvalue()


@pytest.fixture(scope="module")
def finetuned(finetuned_run):
    return finetuned_run[0]


def test_finetuning_starts_from_the_saved_model_and_keeps_its_vocabulary(finetuned, trained_model_dir):
    start = load_file(trained_model_dir / "model.safetensors")
    end = load_file(finetuned / "model.safetensors")
    assert start.keys() == end.keys()
    for name in start:  # a new model would start from random weights
        torch.testing.assert_close(end[name], start[name], atol=1e-6, rtol=0)
    assert AutoTokenizer.from_pretrained(finetuned).get_vocab() == AutoTokenizer.from_pretrained(trained_model_dir).get_vocab()
    config = json.loads((finetuned / "config.json").read_text())
    original = json.loads((trained_model_dir / "config.json").read_text())
    assert {key: config[key] for key in ("d_model", "vocab_size", "max_position_embeddings")} == \
        {key: original[key] for key in ("d_model", "vocab_size", "max_position_embeddings")}
    assert config["dropout"] == 0.2  # a dropout flag given on the command line applies to the loaded model
    results = json.loads((finetuned / "train_results.json").read_text())
    assert results["train_steps"] == 2 and results["train_samples"] > 0
    assert "started from" in (finetuned / "README.md").read_text()


@pytest.mark.parametrize("flags, named", [({"d_model": 96}, "d_model 96 (the model has 64)"),
                                          ({"preset": "small"}, "d_model 256 (the model has 64)")])
def test_size_flags_that_contradict_the_model_are_one_line_errors(flags, named, trained_model_dir, tmp_path,
                                                                  capsys):
    assert main(finetune_flags(tmp_path / "out", trained_model_dir, **flags), MODEL_CARD_TEMPLATE) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: size flags contradict the model") and named in err[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_do_predict_alone_writes_predictions_in_input_order(trained_model, tmp_path, capsys):
    model, tokenizer, model_dir = trained_model
    output_dir = tmp_path / "out"
    flags = finetune_flags(output_dir, model_dir, do_predict=True, num_beams=1, eval_max_new_tokens=12, max_len_a=0,
                           max_len_b=0, train_file=None, validation_file=None)  # a test file is all it needs
    assert main(flags, MODEL_CARD_TEMPLATE) == 0
    assert "test, greedy" in capsys.readouterr().err  # the progress bar of the test decoding
    names = {path.name for path in output_dir.iterdir()}
    assert {"generated_predictions.txt", "predict_results.json", "all_results.json"} <= names
    assert not names & {"model.safetensors", "train_results.json", "eval_results.json"}  # nothing trained
    expected = translate(model, tokenizer, TEST_SOURCES, batch_size=1, num_beams=1, max_new_tokens=12,
                               max_len_a=0, max_len_b=0)
    lines = (output_dir / "generated_predictions.txt").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and lines[:-1] == expected and len(set(expected)) > 1
    results = json.loads((output_dir / "predict_results.json").read_text())
    assert results["predict_samples"] == 7 and {"predict_bleu", "predict_chrf", "predict_gen_len"} <= set(results)
    assert json.loads((output_dir / "all_results.json").read_text())["predict_bleu"] == results["predict_bleu"]


def test_validation_and_test_decoding_are_bounded(trained_model_dir, tmp_path, monkeypatch):
    asked = []  # (longest source, largest bound on new tokens, beams) of every decoding call
    original = TorchBackend.generate

    def generate(self, source_ids, bounds, num_beams, *args, **kwargs):
        asked.append((max(map(len, source_ids)), max(bounds), num_beams))
        return original(self, source_ids, bounds, num_beams, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "generate", generate)
    flags = finetune_flags(tmp_path / "out", trained_model_dir, do_eval=True, do_predict=True, num_beams=2,
                           eval_max_new_tokens=30, max_len_a=0.1, max_len_b=1, per_device_eval_batch_size=2)
    assert main(flags, MODEL_CARD_TEMPLATE) == 0
    assert {beams for _, _, beams in asked} == {1, 2} and len(asked) == 3 + 4 + 4  # validation, test greedy, beam
    for longest_source, max_new_tokens, _ in asked:  # a padded batch is as wide as its longest source
        assert max_new_tokens == math.ceil(0.1 * longest_source + 1) < 30
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert 0 < results["eval_gen_len"] <= max(n for _, n, _ in asked)
    assert json.loads((tmp_path / "out" / "eval_results.json").read_text())["eval_samples"] == 6


def test_eval_or_predict_without_a_model_is_refused(tmp_path, capsys):
    assert main(tiny_run_flags(tmp_path, do_predict=True), MODEL_CARD_TEMPLATE) == 2
    assert "--model_name_or_path" in capsys.readouterr().err


def test_run_state_has_its_own_name(finetuned):
    """Not transformers' `trainer_state.json` (TrainerState), which it is not."""
    checkpoint = finetuned / "checkpoint-2"
    assert (checkpoint / RUN_STATE_FILE).is_file() and not (checkpoint / "trainer_state.json").exists()


# ----------------------------------------------------------------------------------------------------- quiet runs


def test_a_run_shows_no_shared_tensor_warning_nor_map_bars(finetuned_run):
    output_dir, messages, err = finetuned_run
    assert (output_dir / "checkpoint-1").is_dir() and (output_dir / "checkpoint-2").is_dir()  # two saves happened
    assert not [m for m in messages if "Removed shared tensor" in m]
    assert "Map" not in err and "Filter" not in err and "Writing model shards" not in err
    assert any(m.startswith("tokenised and filtered") for m in messages)
    assert "validation, step 2" in err and "test, beam 2" in err  # progress bars of the decoding


def test_plain_generate_and_pipeline_calls_give_no_warnings(finetuned):
    tokenizer = AutoTokenizer.from_pretrained(finetuned)
    model = AutoModelForSeq2SeqLM.from_pretrained(finetuned).eval()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.generate(**tokenizer(["Jesus wept."], return_tensors="pt"), max_new_tokens=5)
            model.generate(**tokenizer(["Jesus wept."], return_tensors="pt"))
            translation_pipeline(model, tokenizer)("Jesus wept.", max_new_tokens=5)
    finally:
        transformers_logger.removeHandler(handler)
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []


# ------------------------------------------------------------------------------------- pipeline, local paths, LoRA


def test_translation_pipeline_can_be_built_twice_on_one_model(trained_model):
    model, tokenizer, _ = trained_model
    first = translation_pipeline(model, tokenizer)("Jesus wept.", max_new_tokens=6)
    second = translation_pipeline(model, tokenizer)("Jesus wept.", max_new_tokens=6)
    assert first == second and first[0]["translation_text"]
    # transformers rewrites the config it is given; a direct call on model.config must not break later ones
    pipeline("translation", model=model, tokenizer=tokenizer, config=copy.deepcopy(model.config),
             pipeline_class=TranslationPipeline)
    assert translation_pipeline(model, tokenizer)("Jesus wept.", max_new_tokens=6) == first
    assert json.loads(model.config.to_json_string())["custom_pipelines"]["translation"]["pt"] == ["AutoModelForSeq2SeqLM"]


@pytest.mark.parametrize("name", ["outputs/nothere", "./nothere", "~/nothere-hf-scratch", "a/b/c", "outputs\\nothere",
                                  "../nothere", "/nothere/at/all"])
def test_a_name_that_looks_like_a_path_is_never_looked_up_on_the_hub(name, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def hub(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args[0]}")

    monkeypatch.setattr(huggingface_hub, "model_info", hub)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", hub)
    monkeypatch.setattr(AutoModelForSeq2SeqLM, "from_pretrained", hub)
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="model directory not found: no such directory") as error:
        load_model_and_tokenizer(name)
    assert time.perf_counter() - started < 0.5
    assert name in str(error.value) and "\n" not in str(error.value)


def test_an_owner_slash_name_is_looked_up_once_then_loaded_from_the_hub(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.chdir(tmp_path)
    asked = []

    def known(name, **kwargs):
        asked.append(("model_info", name, kwargs.get("timeout")))

    def tokenizer(name, *args, **kwargs):
        asked.append(("tokenizer", name, kwargs.get("local_files_only")))
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "model_info", known)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tokenizer)
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer of someone/some-model from the hub"):
        load_model_and_tokenizer("someone/some-model")
    assert asked == [("model_info", "someone/some-model", 10), ("tokenizer", "someone/some-model", False)]

    def unknown(name, **kwargs):
        from httpx2 import Request, Response  # huggingface_hub's HTTP client

        request = Request("GET", f"https://huggingface.co/api/models/{name}")
        raise RepositoryNotFoundError("404 Repository Not Found", response=Response(404, request=request))

    monkeypatch.setattr(huggingface_hub, "model_info", unknown)
    with pytest.raises(ModelLoadError, match="no such directory someone/other, and no such model on the hub"):
        load_model_and_tokenizer("someone/other")


LORA_ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj"]  # README's recipe: every attention projection


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # raised inside peft
def test_lora_recipe_adapts_every_attention_projection(trained_model):
    import peft

    model, tokenizer, _ = trained_model
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_ATTENTION))
    adapted = {re.search(r"((?:en|de)coder\.layers\..*)\.lora_A", name).group(1) for name, p in lora.named_parameters()
               if p.requires_grad and ".lora_A" in name}
    kinds = {"encoder": ("self_attn",), "decoder": ("self_attn", "cross_attn")}
    assert adapted == {f"{stack}.layers.{i}.{kind}.{projection}" for stack, names in kinds.items()
                       for i in range(model.config.encoder_layers) for kind in names for projection in LORA_ATTENTION}
    assert all(".lora_" in name for name, p in lora.named_parameters() if p.requires_grad)
    sources, targets = zip(*PAIRS_EN_ES[:8])
    targets = targets[1:] + targets[:1]  # pairs the model has not learned: its loss starts high
    batch = tokenizer(list(sources), text_target=list(targets), padding=True, return_tensors="pt")
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.Adam([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    lora.train()
    losses = []
    for _ in range(8):
        loss = lora(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    lora.eval()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    decoder_input_ids = torch.ones_like(batch["input_ids"][:, :5])
    with torch.no_grad():
        expected = lora(**inputs, decoder_input_ids=decoder_input_ids).logits
        untouched = model(**inputs, decoder_input_ids=decoder_input_ids).logits
        merged = lora.merge_and_unload()
        assert isinstance(merged, ScratchTransformerForConditionalGeneration)
        torch.testing.assert_close(merged(**inputs, decoder_input_ids=decoder_input_ids).logits, expected,
                                   atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, untouched, atol=1e-3)  # the adapters changed the model


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_common_q_v_recipe_adapts_q_and_v_of_every_attention(trained_model):
    """`["q_proj", "v_proj"]`, the recipe of other models, finds the same names here."""
    import peft

    model, _, _ = trained_model
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    adapted = {re.search(r"((?:en|de)coder\.layers\..*)\.lora_A", name).group(1) for name, _ in lora.named_parameters()
               if ".lora_A" in name}
    layers = model.config.encoder_layers
    expected = {f"encoder.layers.{i}.self_attn.{p}" for i in range(layers) for p in ("q_proj", "v_proj")}
    expected |= {f"decoder.layers.{i}.{kind}.{p}" for i in range(model.config.decoder_layers)
                 for kind in ("self_attn", "cross_attn") for p in ("q_proj", "v_proj")}
    assert adapted == expected

