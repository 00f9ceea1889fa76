"""Off a terminal (a batch job, a pipe) a run prints plain lines: its phases, one line per
logged step, the periodic and final evaluations; no carriage-return progress bar."""

from experiments import train as train_cli


def test_a_run_off_a_terminal_prints_a_line_per_logged_step(corpus_path, tmp_path, capsys):
    code = train_cli.main(["--data", corpus_path, "--d-model", "32", "--n-layers", "2",
                           "--n-heads", "4", "--max-seq-len", "32", "--seq-len", "32",
                           "--batch-size", "4", "--steps", "6", "--log-every", "2",
                           "--eval-every", "4", "--eval-batches", "1", "--final-eval-batches",
                           "2", "--checkpoint-every", "0", "--run-dir", str(tmp_path / "run"),
                           "--cache-dir", str(tmp_path / "cache")])
    out, err = capsys.readouterr()
    assert code == 0 and "\r" not in err + out
    steps = err.splitlines()                      # stderr: the progress lines only
    assert [line.split()[1] for line in steps] == ["2/6", "4/6", "6/6"]
    assert all("loss " in line and "tok_s " in line and "elapsed " in line for line in steps)
    lines = out.splitlines()                      # stdout: the phases, then the summary
    assert lines[0].startswith("set-up: corpus ") and lines[1].startswith("compiling the train")
    assert lines[2].startswith("start-up: before set up ") and " first step " in lines[2]
    assert lines[3].startswith("eval at step 4: loss ")
    assert lines[4] == "final evaluation: 2 validation batches of 4 rows"
