"""The console dashboard: a live bar on a terminal, plain lines every N steps otherwise,
nothing in quiet mode."""

from __future__ import annotations

import io

from relayrl.config.loader import load_config
from relayrl.train.dashboard import Dashboard, clock, status_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def steps(n: int):
    """Metrics rows of n steps, 2 s each; an evaluation at step 2 only."""
    for step in range(1, n + 1):
        row = {
            "step": step,
            "reward_mean": step / 10,
            "pass_rate": 0.5,
            "staleness_mean": 1.25,
            "staleness_max": 3.0,
            "gen_tokens_per_s": 1234.4,
            "train_tokens_per_s": 567.8,
            "elapsed_s": 2.0 * step,
        }
        if step == 2:
            row["eval_pass@1"] = 0.25
        yield row


def run(dashboard: Dashboard, n: int) -> None:
    for row in steps(n):
        dashboard.update(row)
    dashboard.close()


def test_plain_lines_every_n_steps_when_not_a_terminal():
    out = io.StringIO()
    run(Dashboard(5, log_every=2, stream=out), 5)
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert lines[0] == (
        "step 2/5 | reward 0.200 | pass 0.50 | eval pass@1 0.25 | stale 1.25 | max 3 | "
        "gen tok/s 1234 | train tok/s 568 | elapsed 4.0s | eta 6.0s"
    )
    assert "eval pass@1 0.25" in lines[1]  # the latest evaluation stays shown
    assert lines[2].endswith("elapsed 10.0s | eta 0.0s")


def test_quiet_mode_and_log_every_zero_print_nothing():
    for dashboard in (
        Dashboard(4, enabled=False, stream=Terminal()),
        Dashboard(4, log_every=0, stream=io.StringIO()),
    ):
        run(dashboard, 4)
        assert dashboard.stream.getvalue() == ""


def test_live_bar_on_a_terminal():
    term = Terminal()
    run(Dashboard(3, stream=term), 3)
    text = term.getvalue()
    assert "rl step" in text and "3/3" in text
    assert "reward 0.300" in text and "eval pass@1 0.25" in text
    assert "\n" not in text.split("3/3")[0].split("\r")[-1]  # redrawn in place


def test_status_line_skips_what_a_step_did_not_log():
    assert status_line({"step": 1, "reward_mean": 0.5, "eval_pass@1": None}) == "reward 0.500"
    assert clock(59.94) == "59.9s" and clock(125) == "2m05s" and clock(3725) == "1h02m05s"


def test_status_line_shows_the_servers_per_node():
    row = {"reward_mean": 0.5, "servers": "10.0.0.1 1/1 up, 10.0.0.2 0/1 up (1 restarting)"}
    assert status_line(row) == (
        "reward 0.500 | servers 10.0.0.1 1/1 up, 10.0.0.2 0/1 up (1 restarting)"
    )


def test_a_real_pseudo_terminal_gets_the_bar_unless_it_has_no_width():
    import fcntl
    import os
    import pty
    import struct
    import termios

    from relayrl.train.dashboard import is_terminal

    master, slave = pty.openpty()
    try:
        with open(slave, "w", closefd=False) as stream:
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
            assert not is_terminal(stream)  # a size-less pty (some CI runners): plain lines
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
            assert is_terminal(stream)
        assert not is_terminal(io.StringIO())
    finally:
        os.close(master)
        os.close(slave)


def test_the_mismatch_doctor_warns_once_at_the_first_step_that_shows_it(capsys):
    """Fresh tokens' engine-vs-trainer k3 KL above 1e-3 over at least 8 tokens: one warning
    with the likely causes, at step 2 only; stale levels, few tokens or a small KL: none."""
    rows = list(steps(4))
    rows[0].update(mismatch_kl_k3_s0=5e-3, mismatch_tokens_s0=4)  # too few tokens
    rows[0].update(mismatch_kl_k3_s1=0.2, mismatch_tokens_s1=500)  # stale drift: expected
    rows[1].update(mismatch_kl_k3_s0=2.5e-3, mismatch_tokens_s0=120)
    rows[2].update(mismatch_kl_k3_s0=9e-3, mismatch_tokens_s0=120)
    rows[3].update(mismatch_kl_k3_s0=1e-9, mismatch_tokens_s0=120)
    dashboard = Dashboard(4, log_every=2, stream=io.StringIO())
    for row in rows:
        dashboard.update(row)
    dashboard.close()
    [warning] = capsys.readouterr().err.splitlines()
    assert warning.startswith("warning: step 2: the engine and the trainer disagree")
    assert "k3 KL 2.50e-03 over 120 tokens" in warning and "rollout.dtype" in warning
    assert "warning" not in dashboard.stream.getvalue()  # the status lines stay clean

    term = Terminal()
    live = Dashboard(4, stream=term)
    for row in rows:
        live.update(row)
    live.close()
    assert term.getvalue().count("warning: step 2:") == 1


def test_a_bf16_run_warns_above_its_own_rounding_only(capsys):
    """A run that serves bf16 weights measures ~2e-3 on fresh tokens from the rounding it
    chose: its dashboard warns above 1e-2, a float32 run's above 1e-3."""
    rows = list(steps(2))
    rows[0].update(mismatch_kl_k3_s0=1.8e-3, mismatch_tokens_s0=1700)
    rows[1].update(mismatch_kl_k3_s0=3e-2, mismatch_tokens_s0=1700)
    settings = ["train.progress=true", "train.log_every=0", "train.total_steps=2"]
    bf16 = load_config(None, [*settings, "rollout.dtype=bfloat16", "train.mixed_precision=bf16"])
    fp32 = load_config(None, [*settings, "rollout.dtype=float32", "train.mixed_precision=none"])
    for config, warned_at in ((bf16, 2), (fp32, 1)):
        dashboard = Dashboard.for_run(config, 2)
        dashboard.stream = io.StringIO()
        for row in rows:
            dashboard.update(row)
        [warning] = capsys.readouterr().err.splitlines()
        assert warning.startswith(f"warning: step {warned_at}: the engine and the trainer")
