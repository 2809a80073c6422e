"""kvpress's question-answering pipeline over veloxquant caches (veloxquant.kvpress).

Runs where kvpress is installed (scripts/test.sh installs it into a second venv: kvpress 0.5
pins transformers < 5.3). The full method must answer exactly as DynamicCache does under
transformers' eager attention; every method must leave the cache at the context after each
answer (the pipeline's rollback), and answer the same way for a repeated question."""

import pathlib

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

import veloxquant  # noqa: E402
import veloxquant.kvpress  # noqa: E402

MODEL = pathlib.Path(__file__).resolve().parents[2] / "models" / "vq-mini-llama"
CONTEXT = ("The LORD is my shepherd; I shall not want. He maketh me to lie down in green "
           "pastures: he leadeth me beside the still waters. ") * 6
QUESTIONS = ["He leadeth me", "The LORD is", "He leadeth me"]


def load(attn):
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                                attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL)


def test_pipeline_over_every_method(tok):
    eager = veloxquant.kvpress.pipeline(load("eager"), tok, device="cpu")
    ref = eager(CONTEXT, questions=QUESTIONS, cache=DynamicCache(), max_new_tokens=8)["answers"]
    pipe = veloxquant.kvpress.pipeline(load("veloxquant"), tok, device="cpu")
    n_context = len(tok(CONTEXT)["input_ids"])
    for spec in ["full", "snapkv:budget=32", "skvq:bits_key=4:bits_value=4",
                 "snapkv+skvq:budget=48"]:
        cache = veloxquant.Cache(spec)
        answers = pipe(CONTEXT, questions=QUESTIONS, cache=cache, max_new_tokens=8)["answers"]
        assert len(answers) == 3 and answers[0] == answers[2], spec  # rolled back each time
        assert abs(cache.get_seq_length() - n_context) <= 2, spec  # the context (+ template)
        if spec == "full":
            assert answers == ref
        else:
            assert cache.memory()["ratio_to_fp16"] < 1.0
