"""Self-generated prompts (Magpie style) and `specserve distill --prompts FILE / --self-prompts N`, on tiny models."""

import json

import pytest
import torch

from conftest import make_tokenizer, tiny_llama
from serve_app.cli import main
from serve_app.drafting.self_prompts import (generate_self_prompts, kind, load_prompts, normalized, rejection,
                                             save_prompts, turn_tokens, user_turn_prefix)
from serve_app.prompts import encode_chat

SMALL = dict(batch_size=8, max_tokens=40, multi_turn=0.5, reply_tokens=64)  # seconds on the tiny model, whose EOS is rare


@pytest.fixture(scope="module")
def tiny():
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<eos>")
    return tiny_llama(len(tok), 2, seed=0, dtype=torch.float32, eos=eos), tok


@pytest.fixture(scope="module")
def generated(tiny):
    target, tok = tiny
    stats: dict = {}
    return generate_self_prompts(target, tok, 12, seed=0, stats=stats, **SMALL), stats


def test_user_turn_prefix_of_the_tiny_template():
    tok = make_tokenizer()
    assert user_turn_prefix(tok) == "user : "
    history = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a dog"}]
    assert user_turn_prefix(tok, history) == "user : the cat assistant : a dog user : "
    stops, banned = turn_tokens(tok)  # the template closes a turn with plain text: only EOS stops it
    assert stops == {tok.eos_token_id} and banned == {tok.pad_token_id, tok.unk_token_id}


@pytest.mark.embedded
def test_user_turn_prefix_of_the_embedded_template_keeps_its_default_system_prompt():
    from serve_app.models import load_tokenizer

    tok = load_tokenizer("embedded")
    assert user_turn_prefix(tok) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                     "Hugging Face<|im_end|>\n<|im_start|>user\n")
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert user_turn_prefix(tok, history).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                                                   "Hello!<|im_end|>\n<|im_start|>user\n")
    stops, banned = turn_tokens(tok)
    assert stops == {tok.convert_tokens_to_ids("<|im_end|>")}  # the end of the user's turn
    assert tok.convert_tokens_to_ids("<|im_start|>") in banned  # a new turn inside a message: never sampled


def test_generated_prompts_are_nonempty_unique_and_valid_chats(generated):
    prompts, stats = generated
    assert len(prompts) == 12 and stats["kept"] == 12 and stats["generated"] >= 12
    firsts = [p if isinstance(p, str) else p[0]["content"] for p in prompts]
    assert all(rejection(t, True) is None for t in firsts)  # non-empty, long enough, words
    assert len({normalized(t) for t in firsts}) == len(firsts)  # deduplicated
    chats = [p for p in prompts if isinstance(p, list)]
    assert chats and len(chats) < len(prompts)  # multi_turn=0.5: some conversations, some single requests
    for chat in chats:
        assert [m["role"] for m in chat] == ["user", "assistant", "user"]
        assert all(m["content"].strip() for m in chat)
        assert encode_chat(make_tokenizer(), chat)  # goes through the chat template like any request


def test_generation_is_seeded_and_cached(tiny, generated, tmp_path):
    target, tok = tiny
    prompts, _ = generated
    assert generate_self_prompts(target, tok, 12, seed=0, **SMALL) == prompts
    assert generate_self_prompts(target, tok, 12, seed=1, **SMALL) != prompts
    cached = generate_self_prompts(target, tok, 12, seed=0, cache_dir=tmp_path, **SMALL)
    assert cached == prompts and (tmp_path / "round-00000.json").is_file()

    class NoModel:  # a re-run reads the rounds back and never calls the model
        def __call__(self, *args, **kwargs):
            raise AssertionError("regenerated")

    assert generate_self_prompts(NoModel(), tok, 12, seed=0, cache_dir=tmp_path, **SMALL) == prompts
    with pytest.raises(ValueError, match="use those settings"):  # rounds made otherwise are never mixed in
        generate_self_prompts(target, tok, 12, seed=0, cache_dir=tmp_path, **{**SMALL, "max_tokens": 30})


def test_filter_and_kinds_named_cases():
    assert rejection("", True) == "empty"
    assert rejection("What is the capital of France?", False) == "too long"  # never closed its turn
    assert rejection("Hello there", True) == "too short"
    assert rejection("$$ ## {} [] 12 34 %% ^^ &&", True) == "garbage"
    assert rejection("the the the the the the the the the the", True) == "garbage"
    assert rejection("Write a Python function that reverses a string.", True) is None
    assert normalized("  What is  AI? ") == normalized("what is ai")
    assert kind("Write a Python function that reverses a string.") == "code"
    assert kind("Rewrite this sentence so it sounds formal: hey, what's up") == "rewrite"
    assert kind("Write a poem about the sea.") == "creative"
    assert kind("What is the capital of France?") == "question"
    assert kind("Explain how vaccines work.") == "instruction"
    assert kind("I love rainy days.") == "other"
    assert kind([{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "..."},
                 {"role": "user", "content": "Another one?"}]) == "creative"  # the first request decides


def test_jsonl_round_trip_in_the_format_generate_reads(tmp_path):
    prompts = ["What is a black hole?", [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Name a planet."}]]
    path = tmp_path / "p.jsonl"
    save_prompts(path, prompts)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"prompt": prompts[0]}, {"messages": prompts[1]}]
    assert load_prompts(path) == prompts
    path.write_text('{"prompt": "Hi there", "max_tokens": 5}\n\n{"messages": [{"role": "user", "content": "Yo"}]}\n')
    assert load_prompts(path) == ["Hi there", [{"role": "user", "content": "Yo"}]]  # generate's settings ignored
    for bad, why in [('{"prompt": "a"}\n{oops\n', ":2: malformed JSON"), ('{"text": "a"}\n', "prompt"),
                     ('{"prompt": "a", "colour": 1}\n', "unknown field"), ('{"prompt": "  "}\n', "non-empty"),
                     ('{"messages": [{"role": "robot", "content": "x"}]}\n', "messages"), ("\n", "no prompts")]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=why):
            load_prompts(path)


# distill keeps the teacher's top-32 tokens: the tiny vocabulary needs more words than conftest's.
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "big", "red", "blue", "is", "it", "very",
         "or", "sun", "moon", "tree", "bird", "fish", "old", "new", "hot", "cold", "up", "down", "in", "out"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    tok = make_tokenizer(WORDS)
    d = tmp_path_factory.mktemp("tiny") / "target"
    tiny_llama(len(tok), 2, seed=0, dtype=torch.float32, eos=tok.eos_token_id).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _distill_args(target_dir, out, *extra):
    return ["distill", "--target", target_dir, "--out", str(out), "--layers", "1", "--tokens", "16",
            "--max-tokens", "6", "--samples", "0", "--epochs", "1", "--batch-size", "4", *extra]


def _data_prompts(out) -> list[list[int]]:
    chunks = sorted((out / "work" / "data").glob("pass0-*.pt"))
    return [d["ids"][: d["start"]] for f in chunks for d in torch.load(f)]


def test_distill_trains_on_a_prompts_file(target_dir, tmp_path):
    prompts = ["the cat sat on the mat", [{"role": "user", "content": "a dog ran"},
                                          {"role": "assistant", "content": "it is big"},
                                          {"role": "user", "content": "and the cat"}], "is it red or blue"]
    path = tmp_path / "traffic.jsonl"
    save_prompts(path, prompts)
    out = tmp_path / "draft"
    assert main(_distill_args(target_dir, out, "--prompts", str(path))) == 0
    tok = make_tokenizer(WORDS)
    expected = [encode_chat(tok, p if isinstance(p, list) else [{"role": "user", "content": p}]) for p in prompts]
    assert _data_prompts(out) == expected  # the file's prompts, and only those
    meta = json.loads((out / "specserve_draft.json").read_text())
    assert "self_prompts" not in json.dumps(meta)


def test_distill_mixes_self_prompts_into_the_files(target_dir, tmp_path):
    path = tmp_path / "traffic.jsonl"
    save_prompts(path, ["the cat sat on the mat"])
    out = tmp_path / "draft"
    assert main(_distill_args(target_dir, out, "--prompts", str(path), "--self-prompts", "4")) == 0
    data = _data_prompts(out)
    tok = make_tokenizer(WORDS)
    assert len(data) == 5 and data[0] == encode_chat(tok, [{"role": "user", "content": "the cat sat on the mat"}])
    assert len({tuple(d) for d in data}) == 5  # the four written by the target are new
    assert (out / "work" / "self_prompts" / "round-00000.json").is_file()  # cached for a re-run


@pytest.mark.parametrize("content, message", [(None, "no such file"), ('{"prompt": "a"}\nnot json\n', "abc.jsonl:2")])
def test_distill_refuses_a_missing_or_malformed_prompts_file(target_dir, tmp_path, capsys, content, message):
    path = tmp_path / "abc.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(_distill_args(target_dir, tmp_path / "out", "--prompts", str(path))) == 2
    err = capsys.readouterr().err
    assert "--prompts" in err and message in err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_distill_needs_something_to_train_on(target_dir, tmp_path, capsys):
    assert main(_distill_args(target_dir, tmp_path / "out", "--prompts", "0")) == 2
    assert "--self-prompts" in capsys.readouterr().err
