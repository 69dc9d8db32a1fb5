"""Multiset diff of the assertions in tests/ between two git refs of
this repository (WORKTREE = the files on disk).

An assertion: an `assert` statement, a call of a function named assert*
(np.testing.assert_*, the suite's assert_* helpers) or pytest.raises/warns,
each as ast.unparse text (comments and formatting normalised away)."""
import ast, collections, os, subprocess, sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def files(ref):
    if ref == "WORKTREE":
        names = sorted(f for f in os.listdir(f"{REPO}/tests") if f.endswith(".py"))
        return {n: open(f"{REPO}/tests/{n}").read() for n in names}
    names = subprocess.run(["git", "-C", REPO, "ls-tree", "--name-only", ref, "tests/"],
                           capture_output=True, text=True, check=True).stdout.split()
    return {n.split("/", 1)[1]: subprocess.run(["git", "-C", REPO, "show", f"{ref}:{n}"],
                                               capture_output=True, text=True, check=True).stdout
            for n in names if n.endswith(".py")}


def callee(node):
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def assertions(ref):
    found = collections.Counter()
    where = collections.defaultdict(set)
    for name, text in files(ref).items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Assert):
                key = ast.unparse(node)
            elif isinstance(node, ast.Call) and (
                callee(node).startswith("assert")
                or ast.unparse(node.func) in ("pytest.raises", "pytest.warns")
            ):
                key = ast.unparse(node)
            else:
                continue
            found[key] += 1
            where[key].add(name)
    return found, where


a, b = (sys.argv[1:3] + ["main", "suite"][len(sys.argv) - 1:])[:2]
before, wb = assertions(a)
after, wa = assertions(b)
print(f"{a}: {sum(before.values())} assertions ({len(before)} distinct); "
      f"{b}: {sum(after.values())} ({len(after)} distinct)")
for key in sorted(set(before) | set(after)):
    if before[key] != after[key]:
        print(f"{before[key]} -> {after[key]}  {key}   [{a}: {sorted(wb[key])}; {b}: {sorted(wa[key])}]")
moved = [k for k in before if before[k] == after[k] and wb[k] != wa[k]]
print(f"same count, other file(s): {len(moved)}")
for k in moved:
    print(f"  moved {sorted(wb[k])} -> {sorted(wa[k])}: {k[:120]}")
