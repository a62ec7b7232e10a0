"""The paper's downstream tasks (Section 3.2, Table 2) and phonebook lookup (Section 6.2) for lm-evaluation-harness,
offline: task definitions that ``include:`` the harness' own (templates in ``tasks/``), rendered with their documents
read from local JSONL files (``DIR/<task>/<split>.jsonl``), which :func:`export_tasks` writes on a machine with
internet. Nothing is downloaded at evaluation time; a missing file is an error naming it and the export command.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from griffin.evaluation.phonebook import write_jsonl
from griffin.io import atomic_write

TEMPLATES = Path(__file__).with_name("tasks")
# The paper's tasks (Table 2): name -> the harness' definition, relative to lm_eval/tasks.
HARNESS_TASKS = {
    "hellaswag": "hellaswag/hellaswag.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
}
MMLU = "mmlu_continuation"  # the cloze form of MMLU: acc_norm is the paper's character-normalised accuracy
PAPER = ["mmlu", "hellaswag", "piqa", "winogrande", "arc_easy", "arc_challenge"]
PHONEBOOK_ENTRIES = (5, 10, 20, 40, 80, 160)
PHONEBOOK_SAMPLES = 100
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
EXPORT_HINT = ("export the task files on a machine with internet: `griffin eval export-tasks --out DIR --tasks {task}` "
               "(pip install datasets), then pass --task-data DIR")


def harness_tasks_dir() -> Path:
    """The installed ``lm_eval/tasks`` directory."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def mmlu_subjects() -> list[str]:
    """The MMLU subjects of the harness' cloze-form definitions."""
    names = sorted(p.stem for p in (harness_tasks_dir() / "mmlu" / "continuation").glob("mmlu_*.yaml"))
    return [n.removeprefix("mmlu_") for n in names]


def known_tasks() -> list[str]:
    return PAPER + list(HARNESS_TASKS.keys() - set(PAPER)) + ["paper", MMLU, "phonebook"] + \
        [f"phonebook_{n}" for n in PHONEBOOK_ENTRIES]


def expand(tasks: list[str]) -> tuple[list[str], list[str]]:
    """(names to pass to the harness, the concrete tasks behind them): ``paper`` is the six tasks of Table 2,
    ``mmlu`` its cloze form (the group ``mmlu_continuation`` of 57 subjects), ``phonebook`` every book length."""
    names: list[str] = []
    concrete: list[str] = []
    for task in tasks:
        task = task.strip()
        if task == "paper":
            sub = expand(PAPER)
            names += sub[0]
            concrete += sub[1]
        elif task in ("mmlu", MMLU):
            names.append(MMLU)
            concrete += [f"mmlu_{s}_continuation" for s in mmlu_subjects()]
        elif task == "phonebook":
            names.append("phonebook")
            concrete += [f"phonebook_{n}" for n in PHONEBOOK_ENTRIES]
        elif task in HARNESS_TASKS or (task.startswith("phonebook_") and task.removeprefix("phonebook_").isdigit()):
            names.append(task)
            concrete.append(task)
        elif task.startswith("mmlu_") and task.endswith("_continuation") and \
                task.removeprefix("mmlu_").removesuffix("_continuation") in mmlu_subjects():
            names.append(task)
            concrete.append(task)
        else:
            raise ValueError(f"unknown task {task!r}: griffin's offline tasks are {', '.join(known_tasks())} and "
                             "mmlu_<subject>_continuation")
    return list(dict.fromkeys(names)), list(dict.fromkeys(concrete))


def _harness_definition(task: str) -> Path:
    if task in HARNESS_TASKS:
        return harness_tasks_dir() / HARNESS_TASKS[task]
    subject = task.removeprefix("mmlu_").removesuffix("_continuation")
    return harness_tasks_dir() / "mmlu" / "continuation" / f"mmlu_{subject}.yaml"


def _template(task: str) -> str:
    name = "mmlu_subject" if task.startswith("mmlu_") else task
    text = (TEMPLATES / f"{name}.yaml").read_text(encoding="utf-8")
    text = text.replace("{lm_eval_tasks}", harness_tasks_dir().as_posix())
    return text.replace("{subject}", task.removeprefix("mmlu_").removesuffix("_continuation"))


def read_task_yaml(path: Path) -> dict[str, Any]:
    """A harness task file with its ``include:`` files merged under it (its own keys win), ``!function`` tags kept
    as their text: the fields that name the data (dataset, splits)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader) or {}  # noqa: S506 (a SafeLoader)
    includes = cfg.pop("include", None) or []
    merged: dict[str, Any] = {}
    for inc in [includes] if isinstance(includes, str) else includes:
        inc_path = Path(inc) if Path(inc).is_absolute() else path.parent / inc
        merged.update(read_task_yaml(inc_path))
    merged.update(cfg)
    return merged


def harness_config(task: str) -> dict[str, Any]:
    """The harness' own definition of ``task``, its includes resolved."""
    return read_task_yaml(_harness_definition(task))


def render_tasks(tasks: list[str], task_data: str | Path | None, out_dir: str | Path) -> list[str]:
    """Write the task definitions of ``tasks`` into ``out_dir`` (an include path for the harness' TaskManager),
    their documents read from ``task_data``; phonebook data is generated into ``out_dir``. Returns the names to
    evaluate. Every data file is checked before anything is written."""
    import yaml

    names, concrete = expand(tasks)
    out_dir = Path(out_dir)
    plans: list[tuple[str, str, dict[str, Any]]] = []
    for task in concrete:
        if task.startswith("phonebook_"):
            continue
        if task_data is None:
            raise ValueError(f"task {task} reads its documents from local files: pass --task-data DIR; "
                             + EXPORT_HINT.format(task=task))
        cfg = harness_config(task)
        data_files, override = {}, {}
        for key in SPLIT_KEYS:
            split = cfg.get(key)
            if not split:
                continue
            path = Path(task_data) / task / f"{split}.jsonl"
            if path.is_file():
                data_files[split] = str(path.resolve())
            else:
                override[key] = None
        evaluated = cfg.get("test_split") or cfg.get("validation_split")
        if evaluated not in data_files:
            missing = Path(task_data) / task / f"{evaluated}.jsonl"
            raise FileNotFoundError(f"missing task data {missing} (the {evaluated} split of {task}): "
                                    + EXPORT_HINT.format(task=task))
        plans.append((task, _template(task), {"dataset_kwargs": {"data_files": data_files}, **override}))
    out_dir.mkdir(parents=True, exist_ok=True)
    for task, template, extra in plans:
        text = template + yaml.safe_dump(extra, sort_keys=False)
        (out_dir / f"{task}.yaml").write_text(text, encoding="utf-8")
    for task in concrete:
        if task.startswith("phonebook_"):
            entries = int(task.removeprefix("phonebook_"))
            data = write_jsonl(out_dir / "phonebook" / f"{task}.jsonl", entries, PHONEBOOK_SAMPLES, seed=0)
            text = (TEMPLATES / "phonebook.yaml").read_text(encoding="utf-8").replace("{entries}", str(entries))
            extra = {"dataset_kwargs": {"data_files": {"test": str(data.resolve())}}}
            (out_dir / f"{task}.yaml").write_text(text + yaml.safe_dump(extra, sort_keys=False), encoding="utf-8")
    return names


def export_tasks(out_dir: str | Path, tasks: list[str]) -> list[Path]:
    """Download the documents of ``tasks`` with ``datasets`` (needs internet) into ``out_dir/<task>/<split>.jsonl``,
    every split the harness' definition names; each file written whole or not at all."""
    import datasets

    _, concrete = expand(tasks)
    written = []
    for task in concrete:
        if task.startswith("phonebook_"):
            continue  # generated locally
        cfg = harness_config(task)
        splits = {cfg[k] for k in SPLIT_KEYS if cfg.get(k)}
        for split in sorted(splits):
            ds = datasets.load_dataset(cfg["dataset_path"], cfg.get("dataset_name"), split=split,
                                       **{k: v for k, v in (cfg.get("dataset_kwargs") or {}).items()
                                          if k != "trust_remote_code"})
            path = Path(out_dir) / task / f"{split}.jsonl"
            atomic_write(path, lambda tmp, ds=ds: ds.to_json(tmp, lines=True, force_ascii=False))
            written.append(path)
            print(f"{task}/{split}: {len(ds)} documents -> {path}")
    return written


def clear(out_dir: str | Path) -> None:
    shutil.rmtree(out_dir, ignore_errors=True)
