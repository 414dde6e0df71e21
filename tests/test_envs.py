"""Task sources, prompt templates and the gymnasium text environments."""

from __future__ import annotations

import math
import os
import re

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs import ArithmeticTasks, DatasetTasks, MathTextEnv, render_prompt
from envs.arithmetic import in_heldout_region
from envs.datasets import JSON_FIX, JSONL_FIX

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GSM8K = os.path.join(FIXTURES, "gsm8k_sample.jsonl")
MATH = os.path.join(FIXTURES, "math_sample.parquet")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def reference_value(expression: str) -> int:
    """Plain evaluation of "a+b*c-d": sum of signed products, no eval."""
    total = 0
    for sign, term in re.findall(r"([+-]?)([\d*]+)", expression):
        total += (-1 if sign == "-" else 1) * math.prod(int(f) for f in term.split("*"))
    return total


def char_tokenizer(chat_template: str | None = None):
    """A character-level fast tokenizer built in memory (no hub)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


# -- arithmetic tasks ------------------------------------------------------------------------
def test_bare_questions_are_expressions_with_exact_answers():
    tasks = ArithmeticTasks(digits=3, num_operands=4, operators="+-*", seed=1)
    for i in range(300):
        p = tasks.problem(i)
        assert re.fullmatch(r"\d{1,3}([+\-*]\d{1,3}){3}", p.question), p.question
        assert p.answer == str(reference_value(p.question))
        assert p.id == f"arith:{p.question}"
    assert any(tasks.problem(i).answer.startswith("-") for i in range(300))


def test_default_task_is_three_digit_addition():
    p = ArithmeticTasks().problem(0)
    a, b = p.question.split("+")
    assert int(a) + int(b) == int(p.answer) and max(int(a), int(b)) <= 999


@given(
    digits=st.integers(1, 4),
    num_operands=st.integers(2, 4),
    operators=st.sampled_from(["+", "-", "*", "+-", "+*", "-*", "+-*"]),
    seed=st.integers(0, 2**31),
    index=st.integers(0, 2**40),
)
@settings(max_examples=150, deadline=None)
def test_train_problems_are_deterministic_correct_and_never_heldout(digits, num_operands, operators, seed, index):
    tasks = ArithmeticTasks(digits, num_operands, operators, seed=seed)
    p = tasks.problem(index)
    assert p == ArithmeticTasks(digits, num_operands, operators, seed=seed).problem(index)
    operands = [int(x) for x in re.split(r"[+\-*]", p.question)]
    assert len(operands) == num_operands
    assert all(0 <= x <= 10**digits - 1 for x in operands)
    assert set(re.findall(r"[+\-*]", p.question)) <= set(operators)
    assert p.answer == str(reference_value(p.question))
    assert not in_heldout_region(p.question)


def test_operands_cover_the_whole_range():
    tasks = ArithmeticTasks(digits=1, num_operands=2, heldout_size=0)
    seen = {int(x) for i in range(400) for x in tasks.problem(i).question.split("+")}
    assert seen == set(range(10))


def test_heldout_is_fixed_distinct_and_disjoint_from_train_across_seeds():
    heldout = ArithmeticTasks(digits=2, seed=0, heldout_size=200).heldout()
    assert len(heldout) == 200 and len({p.question for p in heldout}) == 200
    assert heldout == ArithmeticTasks(digits=2, seed=5, heldout_size=200).heldout()
    held = {p.question for p in heldout}
    assert all(in_heldout_region(q) for q in held)
    for seed in range(3):
        tasks = ArithmeticTasks(digits=2, seed=seed, heldout_size=200)
        assert not held & {tasks.problem(i).question for i in range(2000)}
    assert [ArithmeticTasks(digits=2, heldout_size=200).problem(i, "heldout") for i in range(3)] == heldout[:3]


def test_large_space_heldout_is_sampled_and_disjoint():
    tasks = ArithmeticTasks()  # 10**6 expressions: rejection-sampled held-out set
    held = {p.question for p in tasks.heldout()}
    assert len(held) == 500
    assert not held & {tasks.problem(i).question for i in range(3000)}


def test_seeds_give_different_train_problems():
    a = [ArithmeticTasks(seed=0).problem(i).question for i in range(50)]
    b = [ArithmeticTasks(seed=1).problem(i).question for i in range(50)]
    assert sum(x != y for x, y in zip(a, b)) > 40


def test_sample_follows_the_generator():
    tasks = ArithmeticTasks()
    assert tasks.sample(np.random.default_rng(3)) == tasks.sample(np.random.default_rng(3))
    assert tasks.sample(np.random.default_rng(3), "heldout") in tasks.heldout()


def test_word_problems_tell_the_same_expression():
    bare = ArithmeticTasks(digits=2, num_operands=4, operators="+-*")
    words = ArithmeticTasks(digits=2, num_operands=4, operators="+-*", word_problems=True)
    for i in range(100):
        b, w = bare.problem(i), words.problem(i)
        assert w.answer == b.answer and w.id == f"arith-word:{b.question}"
        assert re.findall(r"\d+", w.question) == re.findall(r"\d+", b.question)
        assert w.question.endswith("score now?")


def test_too_small_task_space_is_reported():
    with pytest.raises(ValueError, match="held-out expressions"):
        ArithmeticTasks(digits=1, heldout_size=500).heldout()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(digits=0), "digits"),
        (dict(num_operands=1), "num_operands"),
        (dict(operators="/"), "operators"),
        (dict(operators=""), "operators"),
        (dict(operators="++"), "operators"),
        (dict(seed=-1), "seed"),
        (dict(digits=[5, 2]), r"low <= high"),
        (dict(digits=[2, 5, 7]), r"pair \[low, high\]"),
        (dict(digits=[0, 3]), "digits"),
        (dict(digits=True), "digits"),
    ],
)
def test_bad_knobs_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTasks(**kwargs)


# -- templates -------------------------------------------------------------------------------
def test_named_templates():
    plain = render_prompt("123+456")
    assert "123+456" in plain and r"\boxed{}" in plain
    assert render_prompt("123+456", "compact") == "123+456="
    assert render_prompt("7*8", r"Q: {question} A: \boxed{") == r"Q: 7*8 A: \boxed{"


def test_unknown_template_lists_the_named_ones():
    with pytest.raises(ValueError, match="compact"):
        render_prompt("1+1", "fancy")


def test_chat_template_uses_the_tokenizer():
    prompt = render_prompt("1+1", "chat", char_tokenizer(CHAT_TEMPLATE))
    assert prompt.startswith("<|user|>1+1\n") and r"\boxed{}" in prompt
    assert prompt.endswith("<|assistant|>")
    with pytest.raises(ValueError, match="chat template"):
        render_prompt("1+1", "chat", char_tokenizer())
    with pytest.raises(ValueError, match="no tokenizer"):
        render_prompt("1+1", "chat")


# -- dataset tasks ---------------------------------------------------------------------------
def test_gsm8k_jsonl_golds_are_normalised_and_split():
    tasks = DatasetTasks(path=GSM8K, heldout_fraction=0.3)
    problems = [tasks.problem(i) for i in range(tasks.num_problems())] + tasks.heldout()
    assert len(problems) == 12
    answers = {p.question.split()[1]: p.answer for p in problems}
    assert answers["baker"] == "60" and answers["town"] == "1550" and answers["saves"] == "15000"
    assert "-12" in {p.answer for p in problems}
    assert 0 < len(tasks.heldout()) < 12
    assert not {p.id for p in tasks.heldout()} & {tasks.problem(i).id for i in range(tasks.num_problems())}
    again = DatasetTasks(path=GSM8K, heldout_fraction=0.3)
    assert again.heldout() == tasks.heldout()
    assert tasks.sample(np.random.default_rng(0)) == again.sample(np.random.default_rng(0))


def test_math_parquet_with_custom_fields():
    tasks = DatasetTasks(path=MATH, question_field="problem", answer_field="solution", heldout_fraction=0.0)
    golds = {tasks.problem(i).answer for i in range(tasks.num_problems())}
    assert {r"\frac{5}{6}", r"5\sqrt{2}", "4", r"9\pi", r"\{-2, 2\}"} <= golds
    assert tasks.heldout() == []


def test_explicit_heldout_file_is_removed_from_train(tmp_path):
    held = tmp_path / "held.jsonl"
    with open(GSM8K) as f:
        held.write_text("".join(f.readlines()[:3]))
    tasks = DatasetTasks(path=GSM8K, heldout_path=str(held))
    assert len(tasks.heldout()) == 3 and tasks.num_problems("train") == 9


def test_missing_field_names_the_available_ones():
    with pytest.raises(ValueError, match=r"no field 'problem'.*answer.*question"):
        DatasetTasks(path=GSM8K, question_field="problem")


def test_hf_without_datasets_says_how_to_install_or_use_a_file():
    try:
        import datasets  # noqa: F401

        pytest.skip("`datasets` is installed; this checks the message without it")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"pip install .*path="):
        DatasetTasks(hf_name="openai/gsm8k", hf_config="main")


def test_index_out_of_range():
    tasks = DatasetTasks(path=GSM8K)
    with pytest.raises(IndexError, match="out of range"):
        tasks.problem(tasks.num_problems())


# -- environments ----------------------------------------------------------------------------
def test_envs_are_registered_idempotently():
    envs.register_envs()
    envs.register_envs()
    assert {"m2po/Arithmetic-v0", "m2po/MathDataset-v0"} <= set(gym.registry)
    env = gym.make("envs:m2po/Arithmetic-v0", digits=2)
    obs, info = env.reset(seed=0)
    assert info["question"] in obs["prompt"]


def test_same_seed_same_prompt_for_a_group():
    group = [gym.make("m2po/Arithmetic-v0", template="compact") for _ in range(4)]
    history = group[0]
    history.reset(seed=99)  # an env's earlier episodes do not change what a seed selects
    prompts = {env.reset(seed=7)[0]["prompt"] for env in group}
    assert len(prompts) == 1
    others = {gym.make("m2po/Arithmetic-v0").reset(seed=s)[1]["problem_id"] for s in range(20)}
    assert len(others) == 20


def test_single_turn_episode_rewards_the_verifier():
    env = gym.make("m2po/Arithmetic-v0", template="compact")
    obs, info = env.reset(seed=1)
    question, answer = info["question"], info["answer"]
    assert obs == {"prompt": f"{question}="}
    obs, reward, terminated, truncated, info = env.step(rf"\boxed{{{answer}}}")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert (info["correct"], info["extracted"], info["verifier"]) == (True, answer, "fast")
    assert info["answer"] == answer and info["problem_id"] == f"arith:{question}"
    env.reset(seed=1)
    _, reward, terminated, _, info = env.step(r"\boxed{-1}")
    assert (reward, terminated, info["correct"]) == (0.0, True, False)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(r"\boxed{1}")


def test_heldout_evaluation_enumerates_by_index():
    env = gym.make("m2po/Arithmetic-v0", split="heldout", digits=2, heldout_size=50)
    ids = [env.reset(options={"index": i})[1]["problem_id"] for i in range(env.unwrapped.num_problems)]
    expected = [p.id for p in ArithmeticTasks(digits=2, heldout_size=50).heldout()]
    assert ids == expected


def test_multi_turn_feedback_continues_the_episode():
    env = gym.make("m2po/Arithmetic-v0", max_turns=3)
    obs, info = env.reset(seed=2)
    answer = info["answer"]
    obs, reward, terminated, _, info = env.step(r"I guess \boxed{0}")
    assert (reward, terminated, info["turn"]) == (0.0, False, 1)
    assert "The answer 0 is not correct" in obs["prompt"] and obs["prompt"].endswith("Answer:")
    obs, reward, terminated, _, info = env.step(rf"\boxed{{{answer}}}")
    assert (reward, terminated, info["turn"]) == (1.0, True, 2)


def test_multi_turn_ends_after_max_turns_and_feedback_is_overridable():
    class Terse(MathTextEnv):
        def feedback(self, verdict, completion):
            return "no."

    env = Terse(ArithmeticTasks(), max_turns=2)
    env.reset(seed=0)
    obs, _, terminated, _, _ = env.step("nothing")
    assert not terminated and "no." in obs["prompt"] and "nothing" in obs["prompt"]
    _, reward, terminated, _, _ = env.step("still nothing")
    assert (reward, terminated) == (0.0, True)


def test_chat_multi_turn_uses_the_chat_template():
    env = gym.make("m2po/Arithmetic-v0", template="chat", tokenizer=char_tokenizer(CHAT_TEMPLATE), max_turns=2)
    obs, info = env.reset(seed=0)
    obs, *_ = env.step(r"\boxed{0}")
    assert obs["prompt"].count("<|user|>") == 2 and "<|assistant|>\\boxed{0}" in obs["prompt"]
    assert obs["prompt"].endswith("<|assistant|>")


def test_unknown_env_config_key_is_named():
    with pytest.raises(ValueError, match=r"'digitz'.*digits"):
        gym.make("m2po/Arithmetic-v0", digitz=2)
    with pytest.raises(ValueError, match=r"'paht'.*path"):
        gym.make("m2po/MathDataset-v0", paht=GSM8K)


def test_bad_template_fails_at_construction():
    with pytest.raises(ValueError, match="named template"):
        gym.make("m2po/Arithmetic-v0", template="nope")


def test_tokenizer_adds_prompt_token_ids(tmp_path):
    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    env = gym.make("m2po/Arithmetic-v0", tokenizer=str(tmp_path))  # a local path is loaded
    obs, _ = env.reset(seed=4)
    ids = obs["prompt_token_ids"]
    assert ids.dtype == np.int64 and ids.tolist() == tokenizer(obs["prompt"])["input_ids"]
    assert tokenizer.decode(ids.tolist()).replace(" ", "") == obs["prompt"].replace(" ", "")
    assert env.observation_space.contains(obs)


def test_observations_are_in_the_space_without_tokenizer():
    env = gym.make("m2po/Arithmetic-v0", word_problems=True)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs) and set(obs) == {"prompt"}
    assert env.action_space.contains(r"anything \boxed{1}")


def test_dataset_env_from_fixture():
    env = gym.make(
        "m2po/MathDataset-v0",
        path=MATH,
        question_field="problem",
        answer_field="answer",
        heldout_fraction=0.0,
    )
    obs, info = env.reset(seed=3)
    assert info["question"] in obs["prompt"]
    _, reward, _, _, info = env.step(rf"The answer is $\boxed{{{info['answer']}}}$")
    assert reward == 1.0


def test_score_batch_helper():
    env = gym.make("m2po/Arithmetic-v0").unwrapped
    assert env.score_batch([r"\boxed{3}", "#### 4", "5"], ["3", "5", "5"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 answers"):
        env.score_batch(["1", "2", "3"], ["1", "2"])


def test_vector_env_as_rllib_builds_it():
    vec = gym.make_vec("m2po/Arithmetic-v0", num_envs=4, vectorization_mode="sync", digits=2)
    obs, info = vec.reset(seed=[5, 5, 6, 6])
    assert obs["prompt"][0] == obs["prompt"][1] and list(info["answer"][:2]) == [info["answer"][0]] * 2
    _, rewards, terminated, _, _ = vec.step([rf"\boxed{{{a}}}" for a in info["answer"]])
    assert rewards.tolist() == [1.0] * 4 and terminated.all()


def test_problems_handed_out_cannot_corrupt_the_task_source():
    tasks = DatasetTasks(path=GSM8K, heldout_fraction=0.3)
    held = tasks.heldout()
    gold = [(p.question, p.answer, p.id) for p in held]
    with pytest.raises(AttributeError):  # a caller "normalising" a gold answer in place
        held[0].answer = "0"
    held.clear()
    assert [(p.question, p.answer, p.id) for p in tasks.heldout()] == gold
    # Problems are values: the same problem from two sources is equal and dedupes in a set.
    again = DatasetTasks(path=GSM8K, heldout_fraction=0.3).heldout()
    assert again == tasks.heldout() and len(set(again + tasks.heldout())) == len(again)


def test_dataset_problem_ids_are_the_same_in_every_process():
    """`Problem.id` is stable across runs: not Python's salted `hash`, not an object id."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys; from envs import DatasetTasks;"
        "t = DatasetTasks(path=sys.argv[1], heldout_fraction=0.3);"
        "print(json.dumps([p.id for p in t.heldout()] + [t.problem(i).id for i in range(t.num_problems())]))"
    )
    tasks = DatasetTasks(path=GSM8K, heldout_fraction=0.3)
    expected = [p.id for p in tasks.heldout()] + [tasks.problem(i).id for i in range(tasks.num_problems())]
    assert len(set(expected)) == len(expected) == 12
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for hash_seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code, GSM8K], capture_output=True, text=True, check=True, cwd=root,
            env={**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": root},
        )
        assert json.loads(out.stdout) == expected


def test_a_json_error_points_where_the_line_or_file_goes_wrong(tmp_path):
    """A row cut short (no closing brace) is wrong at the end of its line, not at "column 1"
    (json's place once the newline is read); an error inside a line keeps its column; a .json
    file cut short is wrong at its end."""
    data = tmp_path / "mine.jsonl"
    data.write_text('{"question": "What is 1+1?", "answer": "2"}\n{"question": "What is 2+2?", "answer": "4"\n')
    with pytest.raises(ValueError) as err:
        DatasetTasks(path=str(data))
    assert str(err.value) == f"{data}, line 2: not valid JSON (Expecting ',' delimiter at the end of the line); {JSONL_FIX}"
    data.write_text('{"question": "What is 2+2?" "answer": "4"}\n')
    with pytest.raises(ValueError) as err:
        DatasetTasks(path=str(data))
    assert str(err.value) == f"{data}, line 1: not valid JSON (Expecting ',' delimiter at column 29); {JSONL_FIX}"
    data = tmp_path / "mine.json"
    data.write_text('[\n  {"question": "What is 1+1?", "answer": "2"},\n  {"question": "What is 2+2?", "answer": "4"}\n\n')
    with pytest.raises(ValueError) as err:
        DatasetTasks(path=str(data))
    assert str(err.value) == f"{data}: not valid JSON (Expecting ',' delimiter at the end of the file); {JSON_FIX}"


def test_malformed_data_names_the_file_the_line_and_the_field(tmp_path):
    row = '{"question": "What is 1+1?", "answer": "2"}\n'
    data = tmp_path / "mine.jsonl"
    data.write_text(row * 4 + '{"question": "What is 2+2?", "answer": "4\n')  # line 5 unterminated
    with pytest.raises(ValueError, match=rf"^{re.escape(str(data))}, line 5: not valid JSON \("):
        DatasetTasks(path=str(data))
    data.write_text(row + '{"question": "What is 3+3?"}\n')  # row 2 has no answer
    with pytest.raises(ValueError) as err:
        DatasetTasks(path=str(data))
    assert str(err.value) == (
        f"{data}, row 2: no field 'answer' (its fields: ['question']); every row needs 'question' and 'answer'"
    )
