"""Command-line tools: `adacomp run | train | bench | plan | netem`, and the config reference generator."""
