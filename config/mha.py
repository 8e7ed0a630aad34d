"""
The MHA baseline at a one-GPU scale (the paper's GPT-2 size is larger); it follows a dataset file:

    python train_char.py config/enwik8.py config/mha.py     # also config/text8.py, config/mix.py

12 layers of width 512, 8 heads, a context of 512 characters, dropout 0.1: 38,222,848 parameters
with a vocabulary of 256 (enwik8, mix) and 38,105,600 parameters with text8's 27.
config/damcha.py is the same run with DAMCHA at an equal count.
One iteration is 32 x 512 = 16,384 characters, 50,000 of them 819M. On N GPUs keep that batch:
    torchrun --standalone --nproc_per_node=N train_char.py config/enwik8.py config/mha.py \
        --batch_size=$((32 / N)) --gradient_accumulation_steps=N
"""
attn = 'mha'
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
