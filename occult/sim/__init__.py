"""The scale simulator: traffic per device pair, a calibrated cost model, validation and predictions."""
