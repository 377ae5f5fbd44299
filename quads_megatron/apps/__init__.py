"""Applications on top of the library: pretraining a preset (``pretrain``) and the paper's studies (``study``)."""
