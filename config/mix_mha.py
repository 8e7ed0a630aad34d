"""
mix with the MHA baseline, for one GPU: 38,222,848 parameters; config/mix_damcha.py has
38,208,700 (equal within 0.04%). Train, then score the whole val and test splits:

    python train_char.py config/mix_mha.py
    python train_char.py --mode=eval --out_dir=out-mix-mha

Data: the 50-50 mixture of enwik8 and text8: each training row comes from either with
probability 1/2, vocabulary 256; evaluations report both and their mean; downloaded and
prepared on the first run.
Model: 12 layers of width 512, 8 heads, a context of 512 characters, dropout 0.1.
One iteration is 32 x 512 = 16,384 characters; 50,000 iterations are 819M, about 4.5 passes
over each corpus's 90M training characters. On N GPUs keep that batch:
    torchrun --standalone --nproc_per_node=N train_char.py config/mix_mha.py \
        --batch_size=$((32 / N)) --gradient_accumulation_steps=N
"""
out_dir = 'out-mix-mha'
dataset = 'mix'

n_layer = 12
n_head = 8
n_embd = 512
block_size = 512
dropout = 0.1
attn = 'mha'

batch_size = 32
gradient_accumulation_steps = 1
max_iters = 50000
lr_decay_iters = 50000
warmup_iters = 1000
learning_rate = 1e-3
min_lr = 1e-4
beta2 = 0.99
weight_decay = 0.1

eval_interval = 2000
eval_iters = 50
log_interval = 100
compile = True
