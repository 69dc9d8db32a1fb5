"""Every ```python block of README.md and docs/*.md runs as written.

Each block is extracted as it stands (a fence indented inside a list item
is dedented by its fence's indentation) and run in a fresh child process:
`python -c <block>`, its working directory a temporary one (the blocks
write `logs/` and `report/`), this checkout on its path (`helpers.child`).
No prelude is added: a block imports and builds what it uses, on a tiny
model and data made in code. The child's environment is the suite's
TensorFlow one; a block for JAX (docs/jax.md) sets `KERAS_BACKEND` itself
before importing Keras, as a reader's copy must, and so runs on JAX.

One child per block (8 blocks, each a few seconds of work): a failure
names its block (`file:line`, the line of its opening fence) and shows the
child's output. This module runs in the TensorFlow pass only (not in
conftest.ON_JAX); it starts the JAX children itself.
"""

import glob
import os
import re

import pytest

import helpers

FILES = ["README.md"] + sorted(
    os.path.relpath(path, helpers.ROOT)
    for path in glob.glob(os.path.join(helpers.ROOT, "docs", "*.md"))
)

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def python_blocks(relative_path):
    """`[(line, code)]`: the ```python blocks of the file, `line` that of the
    opening fence (1-based), `code` dedented by the fence's indentation."""
    with open(os.path.join(helpers.ROOT, relative_path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, inside = [], None  # inside: (line, indent, language, lines)
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if inside is None:
            if fence:
                inside = (number, fence.group(1), fence.group(2), [])
            continue
        start, indent, language, body = inside
        if fence and fence.group(2) == "" and len(fence.group(1)) <= len(indent):
            if language == "python":
                blocks.append((start, "\n".join(body) + "\n"))
            inside = None
        else:
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
    assert inside is None, f"{relative_path}:{inside[0]}: a fence is never closed"
    return blocks


BLOCKS = [
    pytest.param(code, id=f"{path}:{line}")
    for path in FILES
    for line, code in python_blocks(path)
]


def test_the_runner_finds_the_blocks():
    """The README and the docs hold python blocks, each with code, and no
    block is fenced as python that shows a console session (`>>>`, `$ `)."""
    assert len(BLOCKS) >= 8
    assert any(p.id.startswith("README.md:") for p in BLOCKS)
    assert any(p.id.startswith("docs/") for p in BLOCKS)
    for p in BLOCKS:
        code = p.values[0]
        assert code.strip(), p.id
        compile(code, p.id, "exec")  # valid Python as written
        assert not re.search(r"^(>>>|\$ )", code, re.M), p.id


def test_a_jax_block_sets_its_backend_before_importing_keras():
    """A block that uses JAX chooses the backend itself, before Keras is
    imported (a reader's copy has no KERAS_BACKEND in its environment)."""
    jax_blocks = [p for p in BLOCKS if re.search(r"^import jax\b", p.values[0], re.M)]
    assert jax_blocks  # docs/jax.md's loop
    for p in jax_blocks:
        code = p.values[0]
        choice = code.find('os.environ["KERAS_BACKEND"] = "jax"')
        assert 0 <= choice < code.find("import keras"), p.id


@pytest.mark.slow
@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_as_written(code, tmp_path):
    result = helpers.child("-c", code, cwd=tmp_path)
    assert result.returncode == 0, (
        f"exit status {result.returncode}\n--- stdout (end)\n{result.stdout[-2000:]}"
        f"\n--- stderr (end)\n{result.stderr[-6000:]}"
    )
