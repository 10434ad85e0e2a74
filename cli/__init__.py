"""The `relayrl` command and the tools it reaches around a run: the command line (main.py: train, config, plan,
eval, plot), the dry run (dry_run.py, `train --dry-run`), the run folder's figures (plots.py, `relayrl plot`; the
trainer also draws them when a run ends) and a driver started as a process that can be killed whole
(driver_session.py, for the resume test and the fault-injection benchmark). What a run does is cluster/'s."""
