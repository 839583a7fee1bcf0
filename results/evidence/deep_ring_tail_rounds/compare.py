import csv, glob, sys, collections
d = sys.argv[1]
tags = sorted({f.rsplit('/',1)[1].rsplit('_',1)[0] for f in glob.glob(d + '/*.csv')})
for tag in tags:
    runs = {}
    for o in ['a1','b1','b2','a2']:
        runs[o] = list(csv.DictReader(open(f'{d}/{tag}_{o}.csv')))
    print(f'== {tag}')
    for i, r in enumerate(runs['a1']):
        key = f"D={r['head_dim']} {'causal' if r['causal']=='1' else 'full'} B={r['batch']} Sq={r['seqlen_q']} Sk={r['seqlen_k']} H={r['heads_q']}/{r['heads_kv']}"
        us = {o: float(runs[o][i]['ms'])*1000 for o in runs}
        a = (us['a1']+us['a2'])/2; b = (us['b1']+us['b2'])/2
        print(f"{key:48s} A {us['a1']:8.1f} {us['a2']:8.1f}  B {us['b1']:8.1f} {us['b2']:8.1f}  B/A speed {a/b:.3f}")
