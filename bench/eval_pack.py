"""A small lm-evaluation-harness task pack built from texts that ship with CPython, so an
evaluation needs nothing from a hub (issue 39):

- stdlib_cloze (multiple_choice, loglikelihood): a standard-library function's docstring
  line, then `def` and four names from its module; the right one is the function's.
- stdlib_perplexity (loglikelihood_rolling): topics of pydoc_data.topics (the text
  bench/quant_bench.py measures perplexity on), word/byte perplexity and bits per byte.
- stdlib_generate (generate_until): a docstring line and `>>> module.`; the first
  identifier generated (a regex filter) must be the function's name (exact_match).

`write_evalscope_pack(folder)` writes the cloze's items as EvalScope's general_mcq custom
dataset (subset `stdlib`: a question, choices A-D, the answer's letter), which EvalScope asks
as a generative multiple choice through the chat API.

`write_pack(folder)` writes each task's YAML and JSON-lines data there (absolute paths in the
YAML: lm-eval reads `dataset_path: json` files through datasets' packaged JSON builder, which
reads no hub); pass the folder as lm-eval's --include_path. The items are the same on every
run of the same Python (sorted names, a seeded shuffle).

    python -m bench.eval_pack OUT_DIR   # and EvalScope's data in OUT_DIR/evalscope
"""

from __future__ import annotations

import inspect
import json
import math
import os.path
import pydoc_data.topics
import random
import shutil
import statistics
import sys
import textwrap
from pathlib import Path

TASKS = ("stdlib_cloze", "stdlib_perplexity", "stdlib_generate")
MODULES = (math, os.path, statistics, shutil, textwrap)
NUM_CLOZE, NUM_GENERATE, NUM_TOPICS, TOPIC_CHARS = 50, 12, 4, 1200


def functions() -> list[tuple[str, str, str, list[str]]]:
    """(module, function, its docstring's first line, the module's other function names) for
    each documented function a module defines whose first line does not name it."""
    found = []
    for module in MODULES:
        own = []
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj) or inspect.isclass(obj):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            line = doc.strip().splitlines()[0].strip() if doc else ""
            if len(line) >= 15 and name not in line and "(" not in line:
                own.append((name, line))
        seen = set()
        for name, line in own:
            if line not in seen:
                seen.add(line)
                others = [n for n, _ in own if n != name]
                found.append((module.__name__, name, line, others))
    return found


def cloze_items(rng: random.Random) -> list[dict]:
    items = []
    for module, name, line, others in rng.sample(functions(), NUM_CLOZE):
        choices = [name, *rng.sample(others, 3)]
        rng.shuffle(choices)
        context = f"# {module}: {line}\ndef"
        items.append({"context": context, "choices": choices, "label": choices.index(name)})
    return items


def generate_items(rng: random.Random) -> list[dict]:
    return [
        {"context": f"# {line}\n>>> {module}.", "answer": name}
        for module, name, line, _ in rng.sample(functions(), NUM_GENERATE)
    ]


def perplexity_items() -> list[dict]:
    topics = pydoc_data.topics.topics
    return [{"text": topics[key][:TOPIC_CHARS]} for key in sorted(topics)[:NUM_TOPICS]]


_COMMON = "test_split: test\n"


def _yaml(task: str, data: Path, body: str) -> str:
    # json.dumps: a path as a YAML double-quoted string
    return (
        f"task: {task}\ndataset_path: json\ndataset_kwargs:\n"
        f"  data_files:\n    test: {json.dumps(str(data))}\n{_COMMON}{body}"
    )


_CLOZE = """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

_PERPLEXITY = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""

_GENERATE = """output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n", "("]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
filter_list:
  - name: first_identifier
    filter:
      - function: regex
        regex_pattern: "^\\\\s*([A-Za-z_][A-Za-z0-9_]*)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_pack(folder: Path) -> Path:
    """Writes the pack's YAML and data into `folder`; returns it (lm-eval's include_path)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(39)
    data = {
        "stdlib_cloze": (cloze_items(rng), _CLOZE),
        "stdlib_perplexity": (perplexity_items(), _PERPLEXITY),
        "stdlib_generate": (generate_items(rng), _GENERATE),
    }
    for task, (items, body) in data.items():
        path = folder / f"{task}.jsonl"
        path.write_text("".join(json.dumps(item) + "\n" for item in items))
        (folder / f"{task}.yaml").write_text(_yaml(task, path, body))
    return folder


def write_evalscope_pack(folder: Path, limit: int = NUM_CLOZE) -> Path:
    """The first `limit` cloze items as EvalScope's general_mcq data (`{subset}_val.jsonl`,
    no few-shot `_dev` items) in `folder`; returns it (general_mcq's local_path)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    items = cloze_items(random.Random(39))[:limit]  # write_pack's cloze items, in its order
    rows = [
        {"id": i, "question": item["context"], **dict(zip("ABCD", item["choices"]))}
        | {"answer": "ABCD"[item["label"]]}
        for i, item in enumerate(items)
    ]
    (folder / "stdlib_val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "stdlib_dev.jsonl").write_text("")
    return folder


if __name__ == "__main__":
    print(write_pack(Path(sys.argv[1])))
    print(write_evalscope_pack(Path(sys.argv[1]) / "evalscope"))
