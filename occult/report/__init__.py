"""Tables and figures: the study on the embedded default, committed GPU runs, quality, the paper's claims."""
