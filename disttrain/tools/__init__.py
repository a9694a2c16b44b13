"""Tools around training: environment report and friends."""
