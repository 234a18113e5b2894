"""An engine that dies mid-run (a --colocate engine process killed, a server gone) ends `diffrl train` with
one line naming it, not a traceback."""

import diffrl.train.trainer
from diffrl.cli.main import main
from diffrl.rollout.clients import EngineUnavailable


def test_an_engine_that_died_ends_the_run_in_one_line(monkeypatch, capsys):
    def died(config):
        raise EngineUnavailable("colocated: the engine process ended (EOFError)")

    monkeypatch.setattr(diffrl.train.trainer, "train", died)
    assert main(["train", "--num-rollout", "1"]) == 1
    err = capsys.readouterr().err
    assert err == "error: colocated: the engine process ended (EOFError)\n"
