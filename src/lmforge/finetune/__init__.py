"""Post-training data: chat template, instruction (and later preference) records.

``records`` reads instruction data (chat ``messages``, Alpaca, ``prompt``/``completion``
JSON lines) into lists of (role, content) turns, rejecting bad records with a reason;
``template`` renders turns to token ids with a loss mask, and gives the matching
Hugging Face ``chat_template``.
"""
