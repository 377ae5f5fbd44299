"""Tasks with verifiable rewards: seeded synthetic arithmetic/sorting and a JSONL loader."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from quads_megatron.errors import ConfigError, InputError


@dataclass(frozen=True)
class Sample:
    """One prompt with its reference answer (the verifier compares against it)."""

    prompt: str
    answer: str


class Task:
    """A source of training prompts, a fixed held-out eval set and a reward function."""

    name = "task"

    def train_batch(self, n: int, seed: int) -> list[Sample]:
        """Return n training samples, a pure function of seed (so resume replays exactly)."""
        raise NotImplementedError

    def eval_set(self) -> list[Sample]:
        """Return the fixed held-out set pass@1 is measured on."""
        raise NotImplementedError

    def reward(self, response: str, sample: Sample) -> float:
        """Return 1.0 if the response is correct for sample, else 0.0."""
        raise NotImplementedError

    def sft_text(self, sample: Sample) -> str:
        """Return the target completion used by the supervised warm-up."""
        return sample.answer


class _SyntheticTask(Task):
    """Seeded generator with an eval set disjoint from what training ever draws."""

    def __init__(self, seed: int = 0, eval_size: int = 64):
        self.seed = seed
        rng = random.Random(f"{self.name}-eval-{seed}")
        eval_samples: dict[str, Sample] = {}
        for _ in range(100 * eval_size):
            if len(eval_samples) >= eval_size:
                break
            s = self._make(rng)
            eval_samples.setdefault(s.prompt, s)
        self._eval = list(eval_samples.values())
        self._eval_prompts = set(eval_samples)

    def _make(self, rng: random.Random) -> Sample:
        raise NotImplementedError

    def train_batch(self, n: int, seed: int) -> list[Sample]:
        rng = random.Random(f"{self.name}-train-{self.seed}-{seed}")
        out: list[Sample] = []
        while len(out) < n:
            s = self._make(rng)
            if s.prompt not in self._eval_prompts:
                out.append(s)
        return out

    def eval_set(self) -> list[Sample]:
        return list(self._eval)

    def reward(self, response: str, sample: Sample) -> float:
        return float(response.strip() == sample.answer)


class ArithmeticTask(_SyntheticTask):
    """Addition of two non-negative integers with up to `digits` digits: "37+45=" -> "82"."""

    name = "arithmetic"

    def __init__(self, seed: int = 0, digits: int = 2, eval_size: int = 64):
        if digits < 1:
            raise ConfigError(f"arithmetic task: digits must be >= 1, got {digits}")
        self.digits = digits
        super().__init__(seed, eval_size)

    def _make(self, rng: random.Random) -> Sample:
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return Sample(f"{a}+{b}=", str(a + b))


class SortTask(_SyntheticTask):
    """Sort a string of digits ascending: "sort:3142=" -> "1234"."""

    name = "sort"

    def __init__(self, seed: int = 0, length: int = 4, eval_size: int = 64):
        if length < 2:
            raise ConfigError(f"sort task: length must be >= 2, got {length}")
        self.length = length
        super().__init__(seed, eval_size)

    def _make(self, rng: random.Random) -> Sample:
        digits = [str(rng.randint(0, 9)) for _ in range(self.length)]
        return Sample(f"sort:{''.join(digits)}=", "".join(sorted(digits)))


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _normalize_number(text: str) -> str | None:
    """Return a canonical string for a number ("1,234.50" -> "1234.5"), None if not numeric."""
    t = text.strip().replace(",", "").rstrip(".")
    try:
        v = float(t)
    except ValueError:
        return None
    return str(int(v)) if v == int(v) else repr(v)


def extract_final_answer(text: str) -> str | None:
    """GSM8K-style final answer: after '####', else inside \\boxed{}, else the last number."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def answers_match(response: str, answer: str) -> bool:
    """True if the response's final answer equals the reference (numerically if both are numbers)."""
    got = extract_final_answer(response)
    ref = extract_final_answer(answer) if "####" in answer else answer.strip()
    if got is None or ref is None:
        return False
    g, r = _normalize_number(got), _normalize_number(ref)
    if g is not None and r is not None:
        return g == r
    return got.strip() == ref.strip()


class JsonlTask(Task):
    """Prompts from a JSONL file of {"prompt", "answer"} objects, GSM8K-style answer matching."""

    name = "jsonl"

    def __init__(self, path: str | Path, eval_path: str | Path | None = None, eval_size: int = 64, seed: int = 0):
        self.path = Path(path)
        self.samples = load_jsonl(self.path)
        if eval_path is not None:
            self._eval = load_jsonl(Path(eval_path))
        else:
            # hold out the last eval_size rows (at most a quarter) for pass@1
            n_eval = min(eval_size, len(self.samples) // 4)
            self._eval = self.samples[len(self.samples) - n_eval:] if n_eval else list(self.samples[:1])
            if n_eval:
                self.samples = self.samples[: len(self.samples) - n_eval]
        self.seed = seed

    def train_batch(self, n: int, seed: int) -> list[Sample]:
        rng = random.Random(f"jsonl-{self.seed}-{seed}")
        return [self.samples[rng.randrange(len(self.samples))] for _ in range(n)]

    def eval_set(self) -> list[Sample]:
        return list(self._eval)

    def reward(self, response: str, sample: Sample) -> float:
        return float(answers_match(response, sample.answer))

    def sft_text(self, sample: Sample) -> str:
        return sample.answer


def load_jsonl(path: Path) -> list[Sample]:
    """Read {"prompt", "answer"} rows; InputError naming the file, the line and the field on bad input."""
    if not path.is_file():
        raise InputError(f"JSONL dataset {path}: does not exist or is not a file")
    try:
        with path.open(encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"JSONL dataset {path}: unreadable ({e})") from None
    samples = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{lineno}: expected a JSON object with 'prompt' and 'answer', got {type(row).__name__}")
        missing = [k for k in ("prompt", "answer") if k not in row]
        if missing:
            raise InputError(f"{path}:{lineno}: missing field(s) {missing}; each row needs 'prompt' and 'answer'")
        for k in ("prompt", "answer"):
            if not isinstance(row[k], (str, int, float)) or isinstance(row[k], bool) or not str(row[k]).strip():
                raise InputError(f"{path}:{lineno}: field {k!r} must be a non-empty string, got {row[k]!r}")
        samples.append(Sample(str(row["prompt"]), str(row["answer"])))
    if not samples:
        raise InputError(f"JSONL dataset {path} is empty: expected at least one {{'prompt', 'answer'}} row")
    return samples


def _synthetic_arg(spec: str, name: str, arg: str, default: int) -> int:
    """The integer after 'name:' in a --task spec (its default when absent)."""
    if not arg:
        return default
    if not arg.isdigit():
        raise ConfigError(f"--task {spec!r}: expected '{name}[:N]' with an integer N, got {arg!r}")
    return int(arg)


def check_task_spec(spec: str, eval_path: str | None = None) -> None:
    """Validate a --task / --eval-data pair without building the task (cheap: for parse_args)."""
    name, _, arg = spec.partition(":")
    if name in ("arithmetic", "sort"):
        _synthetic_arg(spec, name, arg, 0)
        if eval_path is not None:
            raise ConfigError(f"--eval-data {eval_path}: only JSONL tasks read an eval file; --task {spec} "
                              "draws its own held-out set")
        return
    if not (spec.endswith(".jsonl") or Path(spec).exists()):
        raise ConfigError(f"--task {spec!r}: expected 'arithmetic[:digits]', 'sort[:length]' or a path to a .jsonl file")
    for flag, path in (("--task", spec), ("--eval-data", eval_path)):
        if path is not None and not Path(path).is_file():
            raise InputError(f"{flag} {path}: JSONL dataset does not exist or is not a file")


def build_task(spec: str, seed: int = 0, eval_path: str | None = None) -> Task:
    """Build a task from a flag value: 'arithmetic[:digits]', 'sort[:length]' or a path to a .jsonl file."""
    check_task_spec(spec, eval_path)
    name, _, arg = spec.partition(":")
    if name == "arithmetic":
        return ArithmeticTask(seed=seed, digits=_synthetic_arg(spec, name, arg, 2))
    if name == "sort":
        return SortTask(seed=seed, length=_synthetic_arg(spec, name, arg, 4))
    return JsonlTask(spec, eval_path=eval_path, seed=seed)
