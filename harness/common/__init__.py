"""The leaf layer: what every other part of harness may import and which imports none of them (the standard
library only): one-line errors (``errors``), the one stop-signal protocol runs and training share (``signals``) and
the files kvlab may touch (``ownership``)."""
