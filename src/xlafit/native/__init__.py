"""Native (C++) extensions: oneDNN convolutions for XLA:CPU (:mod:`xlafit.native.onednn_conv`)."""
