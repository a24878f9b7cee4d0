"""Tools on top of the maths, free of torch and Lightning: the run profile (snapshot), its report, the CLI."""
