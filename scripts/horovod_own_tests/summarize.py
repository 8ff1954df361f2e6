"""Merge the per-rank JUnit XML of run_rank.py into one row per test: passed (every rank), failed
(any rank; the first message), skipped. Usage: python summarize.py DIR [DIR_HOROVOD]."""
import glob
import os
import sys
import xml.etree.ElementTree as ET


def load(folder):
    """Rows from FOLDER/all, each overridden by its isolated re-run FOLDER/alone/<test> if any."""
    rows = _rows(glob.glob(os.path.join(folder, "all", "rank*.xml")) or glob.glob(os.path.join(folder, "rank*.xml")))
    for alone in sorted(glob.glob(os.path.join(folder, "alone", "*"))):
        again = _rows(glob.glob(os.path.join(alone, "rank*.xml")))
        name = os.path.basename(alone)
        if name in again and name not in rows:  # every test ran alone (the Horovod runs)
            rows[name] = again[name]
        elif name in again:
            kind, msg = again[name]
            rows[name] = (kind, msg + " (alone)") if kind != "passed" else ("passed", "passed alone; failed after another test's failure left the ranks out of step")
    return rows


def _rows(paths):
    per = {}
    for path in sorted(paths):
        rank = os.path.basename(path)[4:-4]
        for case in ET.parse(path).getroot().iter("testcase"):
            name = case.get("name")
            kind, msg = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    kind = "skipped" if tag == "skipped" else "failed"
                    msg = (el.get("message") or el.text or "").strip().splitlines()[0][:160] if (el.get("message") or el.text) else tag
                    break
            per.setdefault(name, []).append((rank, kind, msg))
    rows = {}
    for name, results in per.items():
        kinds = {k for _, k, _ in results}
        if "failed" in kinds:  # the cause, not a peer's consequence (its partner left or fell out of step)
            failed = [r for r in results if r[1] == "failed"]
            knock_on = ("Connection closed by peer", "MismatchError", "did not complete within", "Horovod has been shut down")
            rank, _, msg = next((r for r in failed if not any(k in r[2] for k in knock_on)), failed[0])
            rows[name] = ("failed", f"rank {rank}: {msg}")
        elif kinds == {"skipped"}:
            rows[name] = ("skipped", results[0][2])
        else:
            rows[name] = ("passed", "")
    return rows


def main():
    if sys.argv[1] == "--failed":  # the failed tests of one run, for run.sh
        print(" ".join(n for n, (k, _) in sorted(_rows(glob.glob(os.path.join(sys.argv[2], "rank*.xml"))).items())
                       if k == "failed"))
        return
    ours = load(sys.argv[1])
    theirs = load(sys.argv[2]) if len(sys.argv) > 2 else {}
    counts = {}
    for kind, _ in ours.values():
        counts[kind] = counts.get(kind, 0) + 1
    print(f"{len(ours)} tests: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    print("| test | adacomp | horovod 0.28.1 | detail |")
    print("|---|---|---|---|")
    for name in sorted(ours):
        kind, msg = ours[name]
        print(f"| {name} | {kind} | {theirs.get(name, ('-', ''))[0]} | {msg.replace('|', '/')} |")


if __name__ == "__main__":
    main()
