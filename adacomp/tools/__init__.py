"""Command-line tools: `adacomp run | train | bench | plan | netem | advise`, the config reference generator, DDP baselines."""
