from kfac_client.train import main

main()
