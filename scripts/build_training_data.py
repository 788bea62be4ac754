"""Build the embedded model's training data (issue 27): Python source that may be redistributed.

Sources, both already on the machine:

- the running interpreter's whole standard library (``sysconfig.get_paths()["stdlib"]``,
  subpackages included, ``site-packages`` excluded), PSF-2.0;
- the Python files of the distributions installed beside it (``sysconfig`` ``purelib``), kept
  only when the distribution's licence metadata (``importlib.metadata``: ``License-Expression``,
  else ``License``, else the ``License ::`` classifiers) is permissive: every ``AND`` term, or one
  ``OR`` alternative, in ``PERMISSIVE``. Files are attributed to their distribution by its RECORD.
  Vendored folders (``_vendor`` ...) are skipped: their code is under their own licences.

Each file must decode as UTF-8, parse with ``ast`` and be at most ``MAX_FILE_CHARS`` long
(larger ones are generated tables). Duplicates are dropped: exact ones by the SHA-256 of the
text, near ones when a file's set of lines overlaps an already kept file with the same path
inside its package (``httpx/_models.py`` vs ``httpx2/_models.py``) by at least ``NEAR_DUP_JACCARD``.
Standard library files come first, so a copy in a package is the one dropped.

Held out for evaluation, by name, so the same name is held out on every machine:
``FIXED_HELDOUT`` (the stdlib files today's embedded model held out, so both models can be
scored on them) and every file whose ``sha256(f"{HELDOUT_SEED}:{source}/{path}")`` falls in the
first ``HELDOUT_RATE`` of the hash range (tests folders excluded, 1k-100k characters).

Writes into ``--out`` (default ``build/training_data/``, git-ignored):

- ``train.jsonl``, ``heldout.jsonl``: one ``{"source", "path", "text"}`` per line;
- ``heldout.txt``: absolute paths of the held-out files (``benchmarks/eval_default_model.py
  --heldout-list``);
- ``manifest.tsv``: every kept file: split, source, package, version, licence, chars, sha256, path;
- ``DATA.md``: totals by source, each package with its version and licence, what was skipped
  and why (the model folder gets a copy);
- ``chat_train.jsonl``, ``chat_heldout.jsonl``: chat examples built from those files
  (``chat_examples``): ``{"messages": [user, assistant], "text": <ChatML rendering>}``.

Chat examples: for each function whose docstring's first paragraph (or the ``#`` comment right
above it) reads as a description, the user turn is "Write a function that <description>" (the
leading verb put in the third person: "Return" -> "returns") and the assistant turn is the
function's source, dedented. They are rendered with ChatML as Qwen's (``render_chat``);
``CHAT_TEMPLATE`` is the same template as Jinja, for ``tokenizer_config.json``'s
``chat_template``.

Usage:
    OMP_NUM_THREADS=1 python scripts/build_training_data.py [--out DIR] [--no-packages]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata as metadata
import json
import re
import sys
import sysconfig
import textwrap
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "build" / "training_data"
MAX_FILE_CHARS = 500_000
NEAR_DUP_JACCARD = 0.8
HELDOUT_SEED = 27
HELDOUT_RATE = 0.004
FIXED_HELDOUT = ("antigravity.py", "configparser.py", "genericpath.py", "mailbox.py",
                 "plistlib.py", "shlex.py", "symtable.py", "uuid.py")
VENDORED_DIRS = frozenset({"_vendor", "vendor", "_vendored", "vendored", "_extern", "extern"})
SKIP_DISTRIBUTIONS = frozenset({"qwen_ops"})  # this project itself
PERMISSIVE = frozenset({"MIT", "MIT-0", "BSD", "BSD-2-Clause", "BSD-3-Clause", "0BSD", "Apache-2.0",
                        "PSF-2.0", "Python-2.0", "CNRI-Python", "ISC", "Zlib", "CC0-1.0", "BSL-1.0",
                        "Unlicense"})
# Free-form ``License`` fields and trove classifiers, mapped to SPDX identifiers.
LICENSE_NAMES = {
    "mit": "MIT", "mit license": "MIT", "bsd": "BSD", "bsd license": "BSD", "isc": "ISC",
    "isc license": "ISC", "isc license (iscl)": "ISC", "apache 2.0": "Apache-2.0",
    "apache 2.0 license": "Apache-2.0", "apache license 2.0": "Apache-2.0",
    "apache software license": "Apache-2.0", "apache-2.0": "Apache-2.0",
    "python software foundation license": "PSF-2.0",
    "mozilla public license 2.0 (mpl 2.0)": "MPL-2.0", "mpl-2.0": "MPL-2.0",
}


IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)  # ids 0, 1, 2 in the trained tokenizer
# ChatML as in Qwen's tokenizer_config.json (no default system turn, as Qwen3), for Jinja.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_CHAT_FUNCTION_CHARS = 2_000
CHAT_DESCRIPTION_CHARS = (12, 300)


@dataclass(frozen=True)
class SourceFile:
    """One candidate file: ``source`` is ``stdlib`` or the distribution name; ``path`` is relative."""

    source: str
    version: str
    licence: str
    path: str
    abspath: Path
    text: str

    @property
    def group_key(self) -> str:
        # The path inside its top-level package, for near-duplicate checks across packages.
        parts = self.path.split("/")
        return "/".join(parts[1:]) if len(parts) > 1 else parts[0]


def licence_of(dist: metadata.Distribution) -> str:
    """An SPDX-style expression for ``dist``, from its metadata; ``""`` if none is stated."""
    meta = dist.metadata
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        return expression
    free = (meta.get("License") or "").strip()
    if free.lower() in LICENSE_NAMES:
        return LICENSE_NAMES[free.lower()]
    if free and "\n" not in free and len(free) < 100:  # e.g. tqdm's "MPL-2.0 AND MIT"
        return free
    classifiers = [c.split("::")[-1].strip().lower() for c in meta.get_all("Classifier") or []
                   if c.startswith("License ::")]
    names = sorted({LICENSE_NAMES.get(c, c) for c in classifiers})
    return " OR ".join(names)  # several classifiers: the distribution is offered under each


def is_permissive(expression: str) -> bool:
    """True if one ``OR`` alternative has every ``AND`` term (exceptions dropped) in PERMISSIVE."""
    if not expression:
        return False
    for alternative in re.split(r"\s+OR\s+", expression.replace("(", "").replace(")", "")):
        terms = [re.split(r"\s+WITH\s+", t.strip())[0] for t in re.split(r"\s+AND\s+", alternative)]
        if all(t in PERMISSIVE for t in terms):
            return True
    return False


def read_python(path: Path, skipped: Counter) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        skipped["not UTF-8 / unreadable"] += 1
        return None
    if len(text) > MAX_FILE_CHARS:
        skipped[f"over {MAX_FILE_CHARS:,} characters"] += 1
        return None
    if not text.strip():
        skipped["empty"] += 1
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences etc. in old code
            ast.parse(text)
    except (SyntaxError, ValueError):
        skipped["does not parse"] += 1
        return None
    return text


def stdlib_files(skipped: Counter) -> list[SourceFile]:
    root = Path(sysconfig.get_paths()["stdlib"])
    version = sys.version.split()[0]
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "__pycache__" in rel.parts:
            continue
        text = read_python(path, skipped)
        if text is not None:
            out.append(SourceFile("stdlib", version, "PSF-2.0", rel.as_posix(), path, text))
    return out


def package_files(skipped: Counter, packages: list[dict]) -> list[SourceFile]:
    """Python files of permissively licensed distributions; appends one record per distribution."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    out = []
    seen_names = set()
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
        name, version = dist.metadata["Name"], dist.version
        if name in SKIP_DISTRIBUTIONS or name.lower() in seen_names:
            continue
        seen_names.add(name.lower())
        licence = licence_of(dist)
        record = {"package": name, "version": version, "licence": licence or "(none stated)",
                  "kept": is_permissive(licence), "files": 0, "chars": 0}
        packages.append(record)
        if not record["kept"]:
            continue
        for file in sorted(dist.files or [], key=str):
            rel = Path(str(file))
            if rel.suffix != ".py" or ".." in rel.parts or VENDORED_DIRS.intersection(rel.parts):
                if rel.suffix == ".py" and VENDORED_DIRS.intersection(rel.parts):
                    skipped["vendored"] += 1
                continue
            path = site / rel
            if not path.is_file():
                continue
            text = read_python(path, skipped)
            if text is not None:
                out.append(SourceFile(name, version, licence, rel.as_posix(), path, text))
    return out


def deduplicate(files: list[SourceFile], skipped: Counter) -> list[SourceFile]:
    """Drop exact copies (SHA-256) and near copies (line-set Jaccard within a path group)."""
    kept, hashes = [], set()
    groups: dict[str, list[frozenset]] = defaultdict(list)
    for f in files:
        digest = hashlib.sha256(f.text.encode()).hexdigest()
        if digest in hashes:
            skipped["exact duplicate"] += 1
            continue
        lines = frozenset(line.strip() for line in f.text.splitlines() if line.strip())
        if any(len(lines & other) >= NEAR_DUP_JACCARD * len(lines | other) for other in groups[f.group_key]):
            skipped["near duplicate"] += 1
            continue
        hashes.add(digest)
        groups[f.group_key].append(lines)
        kept.append(f)
    return kept


def is_heldout(f: SourceFile) -> bool:
    if f.source == "stdlib" and f.path in FIXED_HELDOUT:
        return True
    if "test" in f.path.split("/") or "tests" in f.path.split("/") or not 1_000 <= len(f.text) <= 100_000:
        return False
    digest = hashlib.sha256(f"{HELDOUT_SEED}:{f.source}/{f.path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < HELDOUT_RATE * 2**64


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """ChatML, as ``CHAT_TEMPLATE`` renders it: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per turn."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def third_person(verb: str) -> str:
    """``Return`` -> ``returns``, ``Process`` -> ``processes``, ``Copy`` -> ``copies``; ``Returns`` stays."""
    word = verb[0].lower() + verb[1:]
    if word.endswith("s") and not word.endswith("ss"):
        return word
    if word.endswith(("ss", "sh", "ch", "x", "z", "o")):
        return word + "es"
    if word.endswith("y") and len(word) > 1 and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def request_from(description: str) -> str | None:
    """'Write a function that ...' from a docstring's first paragraph, or None if it does not fit."""
    text = " ".join(description.strip().split("\n\n")[0].split())
    if not CHAT_DESCRIPTION_CHARS[0] <= len(text) <= CHAT_DESCRIPTION_CHARS[1]:
        return None
    first, _, rest = text.partition(" ")
    if not (first.isalpha() and first[0].isupper() and rest):
        return None  # ">>> ...", "XXX:", a bare name: not a description
    return f"Write a function that {third_person(first)} {rest}"


def chat_examples(text: str) -> list[dict]:
    """Chat examples from one file's functions: ``{"messages": [...], "text": ChatML}`` each."""
    tree = ast.parse(text)
    lines = text.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
            continue
        description = ast.get_docstring(node)
        first_line = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if description is None:  # a comment block right above the def (and its decorators)
            comment, i = [], first_line - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                comment.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            description = " ".join(comment) if comment else None
        request = request_from(description) if description else None
        source = textwrap.dedent("\n".join(lines[first_line - 1:node.end_lineno]))
        if request is None or len(source) > MAX_CHAT_FUNCTION_CHARS:
            continue
        messages = [{"role": "user", "content": request}, {"role": "assistant", "content": source}]
        out.append({"messages": messages, "text": render_chat(messages)})
    return out


def write_outputs(out: Path, train: list[SourceFile], heldout: list[SourceFile], packages: list[dict],
                  skipped: Counter) -> str:
    out.mkdir(parents=True, exist_ok=True)
    for name, files in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        with open(out / name, "w", encoding="utf-8") as fh:
            for f in files:
                fh.write(json.dumps({"source": f.source, "path": f.path, "text": f.text}) + "\n")
    chat_counts = {}
    for name, files in (("chat_train.jsonl", train), ("chat_heldout.jsonl", heldout)):
        n = 0
        with open(out / name, "w", encoding="utf-8") as fh:
            for f in files:
                for example in chat_examples(f.text):
                    fh.write(json.dumps(example) + "\n")
                    n += 1
        chat_counts[name] = n
    (out / "heldout.txt").write_text("# held-out files (scripts/build_training_data.py)\n"
                                     + "".join(f"{f.abspath}\n" for f in heldout))
    with open(out / "manifest.tsv", "w", encoding="utf-8") as fh:
        fh.write("split\tsource\tpackage_version\tlicence\tchars\tsha256\tpath\n")
        for split, files in (("train", train), ("heldout", heldout)):
            for f in files:
                digest = hashlib.sha256(f.text.encode()).hexdigest()
                fh.write(f"{split}\t{f.source}\t{f.version}\t{f.licence}\t{len(f.text)}\t{digest}\t{f.path}\n")

    by_source: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for split, files in ((0, train), (2, heldout)):
        for f in files:
            by_source[f.source][split] += 1
            by_source[f.source][split + 1] += len(f.text)
    for record in packages:
        record["files"], record["chars"] = by_source[record["package"]][0], by_source[record["package"]][1]
    total = [sum(v[i] for v in by_source.values()) for i in range(4)]
    lines = [
        "# Training data of the embedded model (issue 27)",
        "",
        f"Built by `scripts/build_training_data.py` with Python {sys.version.split()[0]} on "
        f"{time.strftime('%Y-%m-%d')}. Every file is listed with its licence and SHA-256 in "
        "`manifest.tsv`.",
        "",
        f"Totals: {total[0]:,} training files, {total[1]:,} characters; {total[2]:,} held-out files, "
        f"{total[3]:,} characters.",
        "",
        "| source | licence | train files | train characters | held-out files | held-out characters |",
        "|---|---|---|---|---|---|",
        f"| Python {sys.version.split()[0]} standard library | PSF-2.0 | "
        + " | ".join(f"{v:,}" for v in by_source["stdlib"]) + " |",
    ]
    for record in packages:
        if record["kept"]:
            v = by_source[record["package"]]
            lines.append(f"| {record['package']} {record['version']} | {record['licence']} | "
                         + " | ".join(f"{x:,}" for x in v) + " |")
    lines += ["", f"Chat examples (user: \"Write a function that ...\" from a docstring or comment; "
              f"assistant: the function): {chat_counts['chat_train.jsonl']:,} from the training files, "
              f"{chat_counts['chat_heldout.jsonl']:,} from the held-out ones."]
    lines += ["", "Left out, not permissive (or no licence stated):", ""]
    lines += [f"- {r['package']} {r['version']}: {r['licence']}" for r in packages if not r["kept"]]
    lines += ["", "Files skipped:", ""] + [f"- {why}: {n:,}" for why, n in sorted(skipped.items())]
    lines += ["", f"Held out by name: the fixed stdlib files {', '.join(FIXED_HELDOUT)} and every file "
              f"whose sha256(\"{HELDOUT_SEED}:source/path\") falls in the first {HELDOUT_RATE:.1%} of the "
              "hash range (no tests folders, 1k-100k characters); the list is `heldout.txt`.", ""]
    report = "\n".join(lines)
    (out / "DATA.md").write_text(report)
    return report


def build(out: Path, include_packages: bool = True) -> str:
    skipped: Counter = Counter()
    packages: list[dict] = []
    files = stdlib_files(skipped)
    if include_packages:
        files += package_files(skipped, packages)
    files = deduplicate(files, skipped)
    heldout = [f for f in files if is_heldout(f)]
    train = [f for f in files if not is_heldout(f)]
    return write_outputs(out, train, heldout, packages, skipped)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-packages", action="store_true", help="the standard library only")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    print(build(args.out, include_packages=not args.no_packages))
    print(f"written to {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
