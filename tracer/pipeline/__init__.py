"""One run, start to end: the request, recording both sides, the noise floor, greedy decoding, regimes, quality."""
