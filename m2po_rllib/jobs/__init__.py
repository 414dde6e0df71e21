"""The jobs room: the `m2po` command line and what it drives (train, eval, export, plan, lab,
report). It imports the algorithm; the algorithm never imports it."""
