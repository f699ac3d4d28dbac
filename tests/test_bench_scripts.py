"""bench/ stays a user of eecore's public surface: no script imports from tests/ or reaches into
an eecore object's private attributes (what a benchmark needs is a public method or hook:
eecore.testing.accept_every_draft, StaticPass.step, LLMEngine.append_tokens, ...), and every script
is listed in bench/README.md."""
from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(list(BENCH.glob("*.py")) + list(BENCH.glob("analysis/*.py")))


def test_no_script_imports_the_tests():
    offenders = [p.name for p in SCRIPTS if re.search(r"sys\.path\.\w+\(.*tests", p.read_text())
                 or re.search(r"^\s*(from|import) (model_factory|engine_utils|test_\w+)\b", p.read_text(), re.M)]
    assert offenders == []


def test_no_script_reaches_into_private_attributes():
    # `x._name` where x is not self/cls (the scripts' own classes) and not a third-party module's
    pattern = re.compile(r"\b(?!self\b|cls\b|torch\b|np\b|os\b|sys\b|llama_cpp\b)[a-z_]+\._[a-z]\w*")
    offenders = [f"{p.name}: {m.group(0)}" for p in SCRIPTS for m in pattern.finditer(p.read_text())]
    assert offenders == []


def test_every_script_is_listed_in_the_readme():
    readme = (BENCH / "README.md").read_text()
    missing = [str(p.relative_to(BENCH)) for p in SCRIPTS if p.name != "__init__.py" and p.name not in readme]
    assert missing == []
