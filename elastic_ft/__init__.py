"""elastic_ft: elastic, fault-tolerant fine-tuning of Hugging Face models on spot capacity."""

__version__ = "0.1.0"
