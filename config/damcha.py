"""
DAMCHA at a one-GPU scale (the paper's GPT-2 size is larger: docs/model.md); it follows a dataset file:

    python train_char.py config/enwik8.py config/damcha.py     # also config/text8.py, config/mix.py

The model, batch and schedule of config/mha.py, with DAMCHA's attention: 38,208,700 parameters
with a vocabulary of 256 (enwik8, mix) and 38,091,452 parameters with text8's 27, against MHA's
38,222,848 and 38,105,600 (equal within 0.04%). The vocabulary adds the same embedding rows to both (the output
layer shares them), so the one generator width below matches MHA on every dataset.
On N GPUs: torchrun --standalone --nproc_per_node=N train_char.py config/enwik8.py config/damcha.py \
    --batch_size=$((32 / N)) --gradient_accumulation_steps=N
"""
attn = 'damcha'
share = True         # one metric generator for the whole stack
gen_out = 'folded'   # it outputs m_i directly: H times fewer output weights than 'full'
gen_depth = 2
gen_width = 188      # spends the 2 x 512^2 query and key weights per layer that DAMCHA lacks
n_layer = 12
n_head = 8
n_embd = 512
block_size = 512
dropout = 0.1                 # embeddings, residual and MLP
attn_dropout = 0.0            # attention probabilities: off, so that --kernel=triton runs these configs

batch_size = 32
max_iters = 50000
warmup_iters = 1000
learning_rate = 1e-3
min_lr = 1e-4
eval_interval = 2000
eval_iters = 50
log_interval = 100
compile = True
