"""Values different from every default of `PreTrainedConfig`'s common arguments (transformers 5).

ConfigTester.check_config_arguments_init builds a config from them and checks each one is kept.
"""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
