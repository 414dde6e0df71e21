"""Dataset-backed math tasks: local .jsonl / .json / .parquet files, or Hugging Face hub names.

Gold answers are normalised with `envs.answers.normalize_gold` (GSM8K "#### 42" -> "42",
the last `\\boxed{}` of a MATH solution, `$` and thousands commas stripped).

Splits. With `heldout_path` (or `hf_heldout_split`), that data is the held-out split and
any train row with the same question is dropped. Otherwise a hash of the question text
puts about `heldout_fraction` of the rows in the held-out split: deterministic, and
independent of row order and seed.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from envs.answers import normalize_gold
from envs.tasks import Problem, check_split


def _question_hash(question: str) -> int:
    return int.from_bytes(hashlib.blake2b(question.encode(), digest_size=8).digest(), "big")


JSONL_FIX = ('fix or remove that line: each line of a .jsonl file is one JSON object, e.g. '
             '{"question": "What is 2+2?", "answer": "4"}')
JSON_FIX = 'fix the file: a .json dataset is one JSON list of objects, e.g. [{"question": "What is 2+2?", "answer": "4"}]'


def _json_place(error: json.JSONDecodeError, text: str, unit: str) -> str:
    """Where in `text` (a line or a file) the JSON went wrong: a column, or its end (where
    an unclosed bracket or a missing value shows, whatever whitespace follows)."""
    if error.pos >= len(text.rstrip()):
        return f"at the end of the {unit}"
    return f"at column {error.colno}"


def load_records(path: str) -> list[dict]:
    """Rows of a local .jsonl, .json (a list of objects) or .parquet file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset file {path!r} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.endswith(".jsonl"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    # Without the newline: JSON cut short at the end of a line would point past
                    # it, at "column 1" of the next one.
                    row = json.loads(line.rstrip())
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}, line {number}: not valid JSON ({e.msg} {_json_place(e, line, 'line')}); "
                        f"{JSONL_FIX}"
                    ) from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}, line {number}: a row must be a JSON object, got {type(row).__name__}")
                rows.append(row)
        return rows
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            where = f"{path}" if e.pos >= len(text.rstrip()) else f"{path}, line {e.lineno}"
            raise ValueError(f"{where}: not valid JSON ({e.msg} {_json_place(e, text, 'file')}); {JSON_FIX}") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path!r} must hold a JSON list of objects, got {type(rows).__name__}")
        return rows
    raise ValueError(f"dataset file {path!r}: expected a .jsonl, .json or .parquet file")


def load_hf(name: str, config: str | None, split: str) -> list[dict]:
    """Rows of a Hugging Face dataset split (needs the `datasets` package and the hub)."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"hf_name={name!r} needs the `datasets` package: pip install 'm2po-rllib[datasets]'. "
            "Without it (or without network), export the data once to a local .jsonl or "
            "parquet file and pass path=... instead."
        ) from e
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:
        raise RuntimeError(
            f"could not load {name!r} (config={config!r}, split={split!r}) from the Hugging Face "
            f"hub: {type(e).__name__}: {e}. If the hub is unreachable, pass path=<local .jsonl/.parquet>."
        ) from e


class DatasetTasks:
    """Math problems from a dataset, with the same API as `ArithmeticTasks`.

    Args:
        path: local .jsonl / .json / .parquet file (or use `hf_name`).
        question_field: the column holding the problem text.
        answer_field: the column holding the gold answer (or a full solution with "####"
            or `\\boxed{}`, which is normalised).
        hf_name: a Hugging Face dataset name (e.g. "openai/gsm8k"), used when `path` is None.
        hf_config: the dataset's config name (e.g. "main" for GSM8K).
        hf_split: the split to train on.
        hf_heldout_split: a split to hold out (e.g. "test"); default: the hash split.
        heldout_path: a local file to hold out; default: the hash split.
        heldout_fraction: the share of rows the hash split holds out.
        name: the prefix of problem ids; default: the file stem or the hub name.
    """

    def __init__(
        self,
        path: str | None = None,
        question_field: str = "question",
        answer_field: str = "answer",
        hf_name: str | None = None,
        hf_config: str | None = None,
        hf_split: str = "train",
        hf_heldout_split: str | None = None,
        heldout_path: str | None = None,
        heldout_fraction: float = 0.1,
        name: str | None = None,
    ):
        if (path is None) == (hf_name is None):
            raise ValueError(
                f"give exactly one of path= (a local file) or hf_name=; got path={path!r}, hf_name={hf_name!r}"
            )
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={heldout_fraction} must be in [0, 1)")
        self.question_field = question_field
        self.answer_field = answer_field
        if path is not None:
            self.name = name or os.path.splitext(os.path.basename(path))[0]
            rows = load_records(path)
            heldout_rows = load_records(heldout_path) if heldout_path else None
        else:
            self.name = name or hf_name
            rows = load_hf(hf_name, hf_config, hf_split)
            heldout_rows = load_hf(hf_name, hf_config, hf_heldout_split) if hf_heldout_split else None
        problems = self._to_problems(rows, path or hf_name)
        if heldout_rows is not None:
            heldout = self._to_problems(heldout_rows, heldout_path or hf_heldout_split)
            held_questions = {p.question for p in heldout}
            train = [p for p in problems if p.question not in held_questions]
        else:
            cut = int(heldout_fraction * 2**64)
            train = [p for p in problems if _question_hash(p.question) >= cut]
            heldout = [p for p in problems if _question_hash(p.question) < cut]
        self._splits = {"train": train, "heldout": heldout}

    def _to_problems(self, rows: list[dict], source: str) -> list[Problem]:
        if not rows:
            raise ValueError(f"{source!r} holds no rows")
        for field in (self.question_field, self.answer_field):
            if field not in rows[0]:
                raise ValueError(
                    f"{source!r} has no field {field!r}; its fields are {sorted(rows[0])}. "
                    "Set question_field= / answer_field="
                )
        seen, problems = set(), []
        for number, row in enumerate(rows, start=1):
            missing = [f for f in (self.question_field, self.answer_field) if f not in row]
            if missing:
                raise ValueError(
                    f"{source}, row {number}: no field {missing[0]!r} (its fields: {sorted(row)}); every row "
                    f"needs {self.question_field!r} and {self.answer_field!r}"
                )
            question = str(row[self.question_field]).strip()
            if question in seen:
                continue  # duplicates would weigh a problem twice and blur the split
            seen.add(question)
            problem_id = f"{self.name}:{_question_hash(question):016x}"
            problems.append(Problem(question, normalize_gold(row[self.answer_field]), problem_id))
        return problems

    def __repr__(self) -> str:
        sizes = {k: len(v) for k, v in self._splits.items()}
        return f"DatasetTasks(name={self.name!r}, sizes={sizes})"

    def num_problems(self, split: str = "train") -> int:
        return len(self._splits[check_split(split)])

    def problem(self, index: int, split: str = "train") -> Problem:
        problems = self._splits[check_split(split)]
        if not 0 <= index < len(problems):
            raise IndexError(f"index {index} out of range for the {split} split of {self!r}")
        return problems[index]

    def sample(self, rng: np.random.Generator, split: str = "train") -> Problem:
        problems = self._splits[check_split(split)]
        if not problems:
            raise ValueError(f"the {split} split of {self!r} is empty")
        return problems[int(rng.integers(len(problems)))]

    def heldout(self) -> list[Problem]:
        return list(self._splits["heldout"])
