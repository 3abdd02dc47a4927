"""What the tests (and bench/) share, one module per concept.

checkpoints  real torch.save checkpoints: settled ones for in-process tests, published ones for daemons
config       the one config builder: presets, deep merge, TOML file, Config object
daemon       a real `mirrord run` process: start, observe (HTTP, metrics, log events), stop, kill
logs         JSON log events out of a child's stderr or a log file
mirror       mirror invariants: every file equals its source, no temp file left, the manifest holds
cli          run the installed `mirrord` as a child process
privileges   run a function in a forked child that dropped root
ports        a free port on 127.0.0.1
wait         poll a condition with a deadline
writer       a trainer process that saves a checkpoint in place with a fault on the way (a script)
train_*      real trainers (HF Trainer, dcp.save, Lightning) saving their own checkpoint folders (scripts)
"""
